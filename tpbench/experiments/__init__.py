"""The kinds of experiment a worker can run: kind name -> function(cfg) -> RankResult.

Each function runs on every rank of an initialised process group and returns that rank's result.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tpbench.config import RunConfig
from tpbench.results import RankResult

KINDS = ("validate", "memory", "throughput")


def experiment(kind: str) -> Callable[[RunConfig], RankResult]:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: accepted are {', '.join(KINDS)}")
    return importlib.import_module(f"tpbench.experiments.{kind}").run
