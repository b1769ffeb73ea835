"""What one rank of an experiment hands back to the launcher, and what the launcher hands on.

Each worker writes its `RankResult` as JSON into the job's result folder; the parent process reads
them all into the run's `Outcome` (with its `Status` and `Environment`) and is the only writer of the
database. Here, below both, so that the launcher and the database need not import each other.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path


class Status(StrEnum):
    """How a run ended."""

    OK = "OK"
    FAILED = "FAILED"
    OOM = "OOM"
    TIMEOUT = "TIMEOUT"
    INTERRUPTED = "INTERRUPTED"
    CANCELLED = "CANCELLED"  # Slurm: scancel (tpbench.run.slurm)
    NODE_FAIL = "NODE_FAIL"  # Slurm: a node of the job failed


@dataclass
class Measurement:
    name: str
    value: float
    unit: str = ""
    step: int | None = None  # None: a per-run figure; otherwise one point of a curve


@dataclass
class ParamRow:
    """One parameter's errors against the matching shard of the dense model (kind=validate): its
    gradient's and, after the AdamW steps, its own; beside them the dense model's against the
    reference model's (tpbench.experiments.criterion). None: not measured (a result of before)."""

    name: str
    semantics: str  # column, row, replicated, replicated_sum, vocab
    shape: list[int]
    grad_mean_abs: float
    grad_max_abs: float
    grad_rel_l2: float
    grad_ref_rel_l2: float | None = None  # the dense gradient against the reference's
    param_max_abs: float | None = None  # after the AdamW steps
    param_rel_l2: float | None = None  # ||sharded - dense|| / ||moved|| (dense's or reference's, the farther)
    param_ref_rel_l2: float | None = None  # ||dense - reference|| / ||moved||
    # the gradient's figures above are those of its worst step (issue 56: checked at every step, at
    # the dense model's weights), this one; the worst row's (a head, a vocabulary row) and its step,
    # None for a vector (tpbench.experiments.grad_check)
    grad_step: int | None = None
    grad_row_rel_l2: float | None = None
    grad_row_ref_rel_l2: float | None = None
    grad_row_step: int | None = None


@dataclass
class CommRow:
    """One collective type on one rank, per training step."""

    op: str  # all_reduce, all_gather, reduce_scatter
    purpose: str  # what it moves: activation, grad_sum, dp_grads, loss, ...
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
    peak_at: str = ""  # memory runs: where the measured peak fell, "<phase> <module>" (memory.PeakTracker)

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
            peak_at=raw["peak_at"],
        )


# How the headline value of a metric is taken over ranks; anything not named here takes the max.
RANK_AGGREGATION = {"passed": "min", "comm_hidden_fraction": "min"}


@dataclass
class Environment:
    """Where a run ran; stored with it (tpbench.run.launch.probe finds it out)."""

    host: str
    device: str
    device_name: str
    device_count: int
    backend: str
    torch_version: str
    cuda_version: str | None
    git_commit: str | None
    git_dirty: bool | None
    slurm_job_id: str | None = None  # inside a Slurm job: its id (an array task as JOB_TASK)
    nodes: str | None = None  # inside a Slurm job: its node list


@dataclass
class Outcome:
    """How one run ended (tpbench.run.launch.run_job, or tpbench.run.slurm for a job that recorded
    nothing)."""

    status: Status
    started_at: datetime
    ended_at: datetime
    env: Environment
    results: list[RankResult] = field(default_factory=list)
    error: str = ""
    failed_rank: int | None = None
    log_dir: str | None = None  # the job folder, kept when the run did not end OK
    ran_rank0: bool = True  # False on the other nodes of a multi-node job: node of rank 0 records it
    job: Path | None = None  # the job folder, until `release` (after the run is recorded)

    def release(self) -> None:
        """Remove the job folder of an OK run; call once the run is recorded (or left to another node)."""
        if self.job is not None and self.log_dir is None:
            shutil.rmtree(self.job, ignore_errors=True)
