"""The folders the code finds from its own file are the checkout's, wherever a module sits in the
package (a module moved one folder down keeps pointing at the same place)."""

from __future__ import annotations

from pathlib import Path

import tpbench
from tpbench.config import CONF_DIR

CHECKOUT = Path(tpbench.__file__).resolve().parents[1]


def test_conf_is_the_checkouts():
    assert CONF_DIR == CHECKOUT / "conf" and (CONF_DIR / "config.yaml").is_file()


def test_the_launcher_asks_git_about_the_checkout():
    from tpbench.run import launch  # torch loads here

    assert launch.REPO == CHECKOUT and (launch.REPO / "pyproject.toml").is_file()
