"""What one rank of an experiment hands back to the launcher.

Each worker writes its `RankResult` as JSON into the job's result folder; the parent process reads
them all and is the only writer of the database.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path


class Status(StrEnum):
    """How a run ended."""

    OK = "OK"
    FAILED = "FAILED"
    OOM = "OOM"
    TIMEOUT = "TIMEOUT"
    INTERRUPTED = "INTERRUPTED"
    CANCELLED = "CANCELLED"  # Slurm: scancel (tpbench.slurm)
    NODE_FAIL = "NODE_FAIL"  # Slurm: a node of the job failed


@dataclass
class Measurement:
    name: str
    value: float
    unit: str = ""
    step: int | None = None  # None: a per-run figure; otherwise one point of a curve


@dataclass
class ParamRow:
    """One parameter's gradient error against the matching shard of the dense gradient."""

    name: str
    semantics: str  # column, row, replicated, replicated_sum, vocab
    shape: list[int]
    grad_mean_abs: float
    grad_max_abs: float
    grad_rel_l2: float


@dataclass
class CommRow:
    """One collective type on one rank, per training step."""

    op: str  # all_reduce, all_gather, reduce_scatter
    purpose: str  # what it moves: activation, grad_sum, dp_grad, loss, ...
    count: int
    bytes: int  # per-rank bytes on the wire of a ring: all-reduce 2(T-1)/T N, gather/scatter (T-1)/T N
    time_s: float | None = None  # timed runs: launch to completion, summed
    exposed_s: float | None = None  # of which the rank waited on it (a blocking collective: all of it)


@dataclass
class RankResult:
    rank: int
    measurements: list[Measurement] = field(default_factory=list)
    params: list[ParamRow] = field(default_factory=list)
    comm: list[CommRow] = field(default_factory=list)
    text: str = ""  # a readable table, printed by the launcher (rank 0)
    failed: list[str] = field(default_factory=list)  # checks out of bounds: the run is FAILED

    def add(self, name: str, value: float, unit: str = "", step: int | None = None) -> None:
        self.measurements.append(Measurement(name, float(value), unit, step))

    def save(self, folder: Path) -> Path:
        path = Path(folder) / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: Path) -> RankResult:
        raw = json.loads(Path(path).read_text())
        return cls(
            rank=raw["rank"],
            measurements=[Measurement(**m) for m in raw["measurements"]],
            params=[ParamRow(**p) for p in raw["params"]],
            comm=[CommRow(**c) for c in raw["comm"]],
            text=raw["text"],
            failed=raw["failed"],
        )


# How the headline value of a metric is taken over ranks; anything not named here takes the max.
RANK_AGGREGATION = {"passed": "min", "comm_hidden_fraction": "min"}
