"""The kinds of experiment a worker can run: kind name -> function(cfg) -> RankResult.

Each function runs on every rank of an initialised process group and returns that rank's result.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tpbench.config import RunConfig
from tpbench.results import RankResult

KINDS = ("validate", "memory", "throughput")


def steady_after(cfg: RunConfig) -> int:
    """A memory run's steps after which every step allocates alike: one (AdamW's state exists), two
    under DDP, whose second forward rebuilds its gradient buckets in the order gradients arrived (old
    and new buckets live at once: 312 KB more than a steady step on the tiny model). Here, not in
    tpbench.experiments.memory, so that the CLI's estimate reads it without importing torch's
    MemTracker (which imports inductor and Dynamo: about 0.9 s)."""
    return 2 if cfg.parallel.engine == "ddp" else 1


def experiment(kind: str) -> Callable[[RunConfig], RankResult]:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: accepted are {', '.join(KINDS)}")
    return importlib.import_module(f"tpbench.experiments.{kind}").run
