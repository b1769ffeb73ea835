"""Faults a worker injects on purpose, so that the runner can be proven to survive them.

Switched on per run with `+fault=NAME` (one file per fault in conf/fault/); users can point the same
switch at their own cluster to see how a crash, a hang or an OOM is reported there.

| fault          | where      | what the worker does                                | recorded as            |
|----------------|------------|-----------------------------------------------------|------------------------|
| raise_on_rank1 | rank 1     | raises RuntimeError once the process group is up    | FAILED                 |
| kill_on_rank1  | rank 1     | sends itself SIGKILL                                | FAILED                 |
| hang_on_rank1  | rank 1     | all-reduces alone; fails after collective_timeout_s | TIMEOUT                |
| hang_in_*_group| rank 1     | the same in its TP, DP or KV-replica group          | TIMEOUT                |
| oom_on_rank1   | rank 1     | allocates twice launch.memory_cap_mb                | OOM                    |
| print_flood    | every rank | writes 32 MiB to stdout and to stderr, then runs    | OK                     |
| big_result     | rank 1     | adds 30 000 curve points to its result              | OK; FAILED if too big  |

"Too big" is a result file over launch.max_result_mb: the parent refuses it without reading it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from tpbench.config import ConfigError, RunConfig, world_size
from tpbench.results import RankResult

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

SUBGROUP_HANGS = ("hang_in_tp_group", "hang_in_dp_group", "hang_in_kv_group")
FAULTS = (
    "raise_on_rank1",
    "kill_on_rank1",
    "hang_on_rank1",
    *SUBGROUP_HANGS,
    "oom_on_rank1",
    "print_flood",
    "big_result",
)

FLOOD_BYTES = 32 << 20
BIG_RESULT_POINTS = 30_000


def before_experiment(cfg: RunConfig, rank: int, device: torch.device) -> None:
    """Inject the configured fault, if any, between process-group setup and the experiment."""
    import torch  # here, not above: tpbench.run.compose reads FAULTS before torch loads
    import torch.distributed as dist

    fault = cfg.fault
    if fault == "print_flood":
        line = f"rank {rank} floods its logs " + "x" * 100 + "\n"
        for _ in range(FLOOD_BYTES // len(line)):
            sys.stdout.write(line)
            sys.stderr.write(line)
        sys.stdout.flush()
        return
    hang = fault == "hang_on_rank1" or fault in SUBGROUP_HANGS
    group = _subgroup(cfg, fault) if fault in SUBGROUP_HANGS else None  # collective: every rank
    if rank != 1:
        if hang:
            threading.Event().wait()  # never joins rank 1's all-reduce; stopped when rank 1 fails
        return
    if fault == "raise_on_rank1":
        raise RuntimeError("injected fault raise_on_rank1: rank 1 raised on purpose")
    if fault == "kill_on_rank1":
        os.kill(os.getpid(), signal.SIGKILL)
    if hang:  # bounded by nothing but the group's own timeout
        dist.all_reduce(torch.ones(1, device=device), group=group)
    if fault == "oom_on_rank1":
        torch.empty(2 * cfg.launch.memory_cap_mb << 20, dtype=torch.uint8, device=device).fill_(1)


def _subgroup(cfg: RunConfig, fault: str) -> dist.ProcessGroup:
    """Rank 1's TP, DP or KV-replica group, made as every experiment makes them."""
    from tpbench.experiments.setup import context

    ctx = context(cfg)
    if fault == "hang_in_kv_group":
        ctx.setup_kv_replicas(cfg.model.num_key_value_heads)
        return ctx.kv_replica_group
    return ctx.tp_group if fault == "hang_in_tp_group" else ctx.dp_group


def after_experiment(cfg: RunConfig, result: RankResult) -> None:
    if cfg.fault == "big_result" and result.rank == 1:
        for step in range(BIG_RESULT_POINTS):
            result.add("fault_big_result", step, step=step)


def check_fault(cfg: RunConfig) -> None:
    """A fault switch refused in one line where the run cannot show it (compose.check calls it)."""
    if cfg.fault.endswith("_on_rank1") and world_size(cfg) < 2:
        raise ConfigError(f"fault={cfg.fault} needs a rank 1, in a world of {world_size(cfg)} rank")
    p, kv = cfg.parallel, cfg.model.num_key_value_heads
    needs = {
        "hang_in_tp_group": (p.tp >= 2, "parallel.tp >= 2"),
        "hang_in_dp_group": (p.dp >= 2, "parallel.dp >= 2"),
        "hang_in_kv_group": (p.tp > kv, f"parallel.tp > model.num_key_value_heads={kv}"),
    }
    if cfg.fault in needs and not needs[cfg.fault][0]:
        raise ConfigError(f"fault={cfg.fault} needs {needs[cfg.fault][1]}: rank 1 must share such a group")
    if cfg.fault == "oom_on_rank1" and cfg.launch.memory_cap_mb == 0:
        raise ConfigError("fault=oom_on_rank1 needs a cap to exceed: launch.memory_cap_mb > 0")
