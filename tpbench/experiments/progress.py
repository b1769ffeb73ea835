"""An experiment's progress through its steps, one line on stdout at most every EVERY_S seconds.

Local rank 0 of each node prints, as `validate step 12/20 · 3.1 s elapsed · ~2.0 s left` (flushed):
the launcher passes the last line of that rank's stdout to the command line's progress
(tpbench.run.launch's _Tail). Nothing prints outside a torchrun worker (no LOCAL_RANK): `tpbench plan
--measure` and the tests run experiments in their own process.
"""

from __future__ import annotations

import os
import time

EVERY_S = 0.5


class StepProgress:
    """Say each step as it ends: the first, then at most every EVERY_S seconds, and the last."""

    def __init__(self, what: str, total: int):
        self.what, self.total = what, total
        self.shown = os.environ.get("LOCAL_RANK") == "0"
        self.start = self.said = time.perf_counter()
        self.done = 0

    def step(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if not self.shown or (1 < self.done < self.total and now - self.said < EVERY_S):
            return
        self.said = now
        elapsed = now - self.start
        left = elapsed / self.done * (self.total - self.done)
        print(
            f"{self.what} step {self.done}/{self.total} · {elapsed:.1f} s elapsed · ~{left:.1f} s left",
            flush=True,
        )
