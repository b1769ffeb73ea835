"""Who talks to whom: a world of dp x tp ranks on a DeviceMesh.

TP groups are adjacent ranks (rank = d * tp + t), so on one node they share the fastest links;
DP groups run across them. With GQA and tp > N_kv, each KV head lives on tp / N_kv ranks of a TP
group; those ranks form a KV-replica group whose k/v gradients are summed.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelContext:
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    device: torch.device
    tp_group: dist.ProcessGroup | None  # None: a single process, every collective is the identity
    dp_group: dist.ProcessGroup | None
    mesh: DeviceMesh | None = None
    kv_replica_group: dist.ProcessGroup | None = None  # set by setup_kv_replicas when tp > N_kv
    timeout: timedelta | None = None  # of every collective in the groups made here

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp + self.tp_rank

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        """The context of a dense, single-process run."""
        return cls(1, 1, 0, 0, torch.device(device), None, None)

    @classmethod
    def from_world(
        cls, tp: int, dp: int, device: torch.device, timeout: timedelta | None = None
    ) -> ParallelContext:
        """Build the mesh from an initialised default process group of dp * tp ranks, whose tensors
        live on `device` (the worker has made it the current CUDA device). Every group is made here
        with `timeout` (init_device_mesh would give its sub-groups torch's default, 30 minutes,
        whatever the world group has); None: torch's default."""
        world = dist.get_world_size()
        if world != tp * dp:
            raise ValueError(f"world size {world} != dp {dp} x tp {tp}")
        grid = torch.arange(world).view(dp, tp)  # rank = d * tp + t
        rank = dist.get_rank()
        tp_group = _own_group([row.tolist() for row in grid], rank, timeout)
        dp_group = _own_group([col.tolist() for col in grid.t()], rank, timeout)
        mesh = DeviceMesh.from_group([dp_group, tp_group], device.type, grid, mesh_dim_names=("dp", "tp"))
        return cls(
            tp=tp,
            dp=dp,
            tp_rank=rank % tp,
            dp_rank=rank // tp,
            device=device,
            tp_group=tp_group,
            dp_group=dp_group,
            mesh=mesh,
            timeout=timeout,
        )

    @classmethod
    def of_world(
        cls, tp: int, dp: int, device: torch.device, timeout: timedelta | None = None
    ) -> ParallelContext:
        """`from_world`, once per shape of the world in a process: a fresh context on the groups and
        mesh that the first call for this (tp, dp, device, timeout) made (collective, as from_world:
        every rank calls it with the same shapes in the same order).

        A warm worker runs a sweep's configs one after another in one process, a test job a hundred.
        A gloo group keeps threads that wake to poll its sockets for as long as it lives (50 idle groups
        cost a rank 0.6-1 CPU s per 10 s, most of it sys: scripts/gloo-idle-groups.py), and nothing
        destroyed a config's groups: a sweep's later runs were slowed by its earlier ones' groups.
        Destroying them after each config is no way out: DTensor's caches hand a later config an
        earlier one's mesh."""
        key = ("world", tp, dp, str(device), timeout)
        made = _made_in_this_world()
        if key not in made:
            made[key] = cls.from_world(tp, dp, device, timeout)
        return dataclasses.replace(made[key])

    def setup_kv_replicas(self, num_kv_heads: int) -> None:
        """Create the groups of TP ranks sharing one KV head (collective: every rank must call), once
        per shape in a process (as `of_world`)."""
        if self.tp <= num_kv_heads or self.tp_group is None:
            return
        key = ("kv", self.tp, self.dp, num_kv_heads, self.timeout)
        made = _made_in_this_world()
        if key in made:
            self.kv_replica_group = made[key]
            return
        replicas = self.tp // num_kv_heads
        for d in range(self.dp):
            for head in range(num_kv_heads):
                ranks = [d * self.tp + head * replicas + r for r in range(replicas)]
                group = dist.new_group(ranks, timeout=self.timeout)
                if self.rank in ranks:
                    self.kv_replica_group = group
        made[key] = self.kv_replica_group


# the groups made by of_world and setup_kv_replicas, for the default group they were made in
_MADE: dict[tuple, object] = {}
_MADE_IN: list[object] = [None]


def leave_world() -> None:
    """Destroy the default process group and every group made in it, the ones `of_world` keeps
    included, while the interpreter is whole. A group still referenced when the process exits is
    destroyed in the interpreter's own teardown, where gloo's threads can end in std::terminate
    ("terminate called without an active exception", SIGABRT) on a rank whose work was done: its
    agent then calls the run failed, and stops the ranks still writing."""
    _MADE.clear()
    _MADE_IN[0] = None
    dist.destroy_process_group()
    gc.collect()


def exit_now() -> NoReturn:
    """End this rank's process, its work done and `leave_world` called, without the interpreter's
    teardown: status 0, stdout and stderr flushed first.

    Groups that objects still hold outlive `leave_world`: after a ZeRO-2 memory run, FSDP2's modules
    stay reachable from autograd nodes that C++ holds, out of the cycle collector's reach, and three
    gloo groups' threads still run. Destroyed in the teardown, they aborted the rank ("terminate
    called without an active exception", SIGABRT) in 2 of 25 such runs here, after its results were
    handed in; its agent then calls the run failed. Nothing is left to do at that point that the
    teardown would do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _made_in_this_world() -> dict[tuple, object]:
    """The groups made so far under the current default process group: none once it has been
    destroyed and another made (an emulated rank's, made per measurement), whose groups died with it."""
    world = dist.group.WORLD
    if _MADE_IN[0] is not world:
        _MADE.clear()
        _MADE_IN[0] = world
    return _MADE


def _own_group(all_ranks: list[list[int]], rank: int, timeout: timedelta | None) -> dist.ProcessGroup:
    """Create every group of `all_ranks` (collective: each rank creates them all); return this rank's."""
    groups = [dist.new_group(ranks, timeout=timeout) for ranks in all_ranks]
    return next(g for g, ranks in zip(groups, all_ranks, strict=True) if rank in ranks)
