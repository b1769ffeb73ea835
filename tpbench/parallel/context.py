"""Who talks to whom: a world of dp x tp ranks on one DeviceMesh, whose named dims give every group.

TP groups are adjacent ranks (rank = d * tp + t), so on one node they share the fastest links;
DP groups run across them. A layout's mesh, made once per job (`of_world`), holds them all:

    (dp, tp)                             every layout: ctx.mesh, its dims the TP and DP groups
    (dp_replicate, dp_shard, tp)         HSDP: dp unflattened, DP rank d = r * dp_shard + s; FSDP2's
                                         2-D mesh is its (dp_replicate, dp_shard), the DTensor engine's
                                         TP mesh its tp: one mesh, so fully_shard composes them
    tp -> (kv_head, kv_replica)          with GQA and tp > N_kv each KV head lives on tp / N_kv ranks of
                                         a TP group; the kv_replica dim sums their k/v gradients

The dp group is DDP's and ZeRO-1's; without HSDP the dp dim is FSDP2's mesh. A layout's later runs
in the job get the very same mesh, sub-meshes and groups. torch's DeviceMesh makes
the groups (init_device_mesh, DeviceMesh._unflatten as torchtitan's ParallelDims.build_mesh does), each
with tpbench's timeout passed as the backend's options: without them its groups wait torch's default,
30 minutes, whatever the world group has. Groups nothing uses (the kv_head dim) are torch's fake backend,
which holds no sockets or threads, as torchtitan makes its unused dims.
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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelContext:
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    device: torch.device
    tp_group: dist.ProcessGroup | None  # None: a single process, every collective is the identity
    dp_group: dist.ProcessGroup | None
    mesh: DeviceMesh | None = None  # the layout's: (dp, tp), or HSDP's (dp_replicate, dp_shard, tp)
    kv_replica_group: dist.ProcessGroup | None = None  # set by setup_kv_replicas when tp > N_kv
    timeout: timedelta | None = None  # of every collective in the groups made here
    dp_replicate: int = 1  # HSDP's replicas (parallel.dp_replicate): the mesh's dp_replicate dim
    tp_mesh: DeviceMesh | None = None  # mesh["tp"]: the DTensor engine's
    fsdp_mesh: DeviceMesh | None = None  # FSDP2's: mesh["dp"], or HSDP's (dp_replicate, dp_shard)

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp + self.tp_rank

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        """The context of a dense, single-process run."""
        return cls(1, 1, 0, 0, torch.device(device), None, None)

    @classmethod
    def from_world(
        cls,
        tp: int,
        dp: int,
        device: torch.device,
        timeout: timedelta | None = None,
        dp_replicate: int = 1,
    ) -> ParallelContext:
        """Build the layout's mesh from an initialised default process group of dp * tp ranks, whose
        tensors live on `device` (the worker has made it the current CUDA device); every group made
        here waits `timeout` (None: torch's default). Collective: every rank calls it with the same
        shapes in the same order."""
        world = dist.get_world_size()
        if world != tp * dp:
            raise ValueError(f"world size {world} != dp {dp} x tp {tp}")
        names = ("dp", "tp")
        with _real():
            mesh = init_device_mesh(
                device.type, (dp, tp), mesh_dim_names=names, backend_override=_timed(names, timeout)
            )
        return cls._of_mesh(mesh, device, timeout, dp_replicate)

    @classmethod
    def _of_mesh(
        cls, mesh: DeviceMesh, device: torch.device, timeout: timedelta | None, replicate: int
    ) -> ParallelContext:
        """The context of a (dp, tp) mesh; under HSDP (replicate > 1) its dp dim unflattened into
        (dp_replicate, dp_shard), whose groups are made here: its tp and dp groups stay the mesh's."""
        dp, tp = mesh.shape
        if replicate < 1 or dp % replicate:
            raise ValueError(f"dp_replicate {replicate} does not divide dp {dp}")
        layout, fsdp = mesh, mesh["dp"]
        if replicate > 1:
            hsdp = ("dp_replicate", "dp_shard")
            with _real():
                layout = mesh._unflatten("dp", (replicate, dp // replicate), hsdp, _timed(hsdp, timeout))
            fsdp = layout[hsdp]
        rank = dist.get_rank()
        return cls(
            tp=tp,
            dp=dp,
            tp_rank=rank % tp,
            dp_rank=rank // tp,
            device=device,
            tp_group=mesh.get_group("tp"),
            dp_group=mesh.get_group("dp"),
            mesh=layout,
            timeout=timeout,
            dp_replicate=replicate,
            tp_mesh=layout["tp"],
            fsdp_mesh=fsdp,
        )

    @classmethod
    def of_world(
        cls,
        tp: int,
        dp: int,
        device: torch.device,
        timeout: timedelta | None = None,
        dp_replicate: int = 1,
    ) -> ParallelContext:
        """`from_world`, once per layout of the world in a process: a fresh context on the mesh, its
        sub-meshes and groups that the first call for this (tp, dp, dp_replicate, device, timeout) made
        (collective, as from_world). An HSDP layout unflattens the (dp, tp) layout's mesh: it shares
        its TP and DP groups, and makes only its replicate and shard groups.

        A warm worker runs a sweep's configs one after another in one process, a test job a hundred.
        A gloo group keeps threads that wake to poll its sockets for as long as it lives (50 idle groups
        cost a rank 0.6-1 CPU s per 10 s, most of it sys: scripts/gloo-idle-groups.py), and nothing
        destroyed a config's groups: a sweep's later runs were slowed by its earlier ones' groups.
        Destroying them after each config is no way out: DTensor's caches hand a later config an
        earlier one's mesh."""
        key = ("world", tp, dp, dp_replicate, str(device), timeout)
        made = _made_in_this_world()
        if key not in made:
            if dp_replicate == 1:
                made[key] = cls.from_world(tp, dp, device, timeout)
            else:
                base = cls.of_world(tp, dp, device, timeout)
                made[key] = cls._of_mesh(base.mesh, device, timeout, dp_replicate)
        return dataclasses.replace(made[key])

    def with_replicas(self, replicate: int) -> ParallelContext:
        """This layout's context under HSDP with `replicate` replicas (parallel.dp_replicate; 1: none),
        as of_world makes it: the mesh a config's FSDP2 and DTensor TP take their dims from, where
        validate builds several configs on the first one's context (collective, as of_world)."""
        if replicate == self.dp_replicate:
            return self
        return ParallelContext.of_world(self.tp, self.dp, self.device, self.timeout, replicate)

    def setup_kv_replicas(self, num_kv_heads: int) -> None:
        """The group of TP ranks sharing this rank's KV head: the kv_replica dim of the mesh's tp dim
        unflattened into (kv_head, kv_replica), made once per shape in a process (as `of_world`;
        collective: every rank must call)."""
        if self.tp <= num_kv_heads or self.tp_group is None:
            return
        key = ("kv", self.tp, self.dp, num_kv_heads, str(self.device), self.timeout)
        made = _made_in_this_world()
        if key not in made:
            _register_fake_backend()
            override = {"kv_head": "fake", **(_timed(("kv_replica",), self.timeout) or {})}
            sizes = (num_kv_heads, self.tp // num_kv_heads)
            with _real():
                kv = self.mesh._unflatten("tp", sizes, ("kv_head", "kv_replica"), override)
            made[key] = kv.get_group("kv_replica")
        self.kv_replica_group = made[key]


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


def _timed(names: tuple[str, ...], timeout: timedelta | None) -> dict | None:
    """DeviceMesh's backend_override giving each of `names`' groups `timeout` (None: torch's default)."""
    return None if timeout is None else {name: _options(timeout) for name in names}


def _options(timeout: timedelta):
    """The default group's backend's options, waiting `timeout`: DeviceMesh hands their timeout to
    each group it makes (NCCL's, gloo's and the fake backend's each take only their own class)."""
    backend = dist.get_backend()  # gloo, nccl, fake, cuda:fake, cpu:gloo,cuda:nccl
    if "nccl" in backend:
        options = dist.ProcessGroupNCCL.Options()
    elif "fake" in backend:
        options = torch._C._distributed_c10d.FakeProcessGroup.Options()
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def _real():
    """Outside fake tensor mode: a mesh's ranks are real tensors, where an emulated rank sets up its KV
    replicas or FSDP2 its HSDP mesh under FakeTensorMode (DeviceMesh's own slicing does the same)."""
    return torch._subclasses.fake_tensor.unset_fake_temporarily()


def _register_fake_backend() -> None:
    """torch's fake backend, for the mesh dims nothing communicates over (registered on import)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
