"""The cycle collector paused while a process imports torch and tpbench's layers above it.

Importing torch makes millions of objects and frees few of them; Python's cycle collector, run every
700 allocations, scans the young ones again and again while they pile up (a third of a worker's import
time). Paused for the imports, with what they made frozen afterwards (`gc.freeze`: kept out of every
later collection, as objects that live as long as the process), a worker imports tpbench.run.worker
and an experiment in 1.3 CPU s instead of 2.2 on the 2-core EPYC, its first full collection
included (`python -c "import gc; gc.disable(); import tpbench.run.worker, tpbench.experiments.validate;
gc.freeze(); gc.enable(); gc.collect()"` against the same without the pause).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cycle collection inside; afterwards what exists is frozen and collection is as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
