"""`python -m tpbench ...`: the command line without the installed `tpbench` script."""

from tpbench.cli import app

app()
