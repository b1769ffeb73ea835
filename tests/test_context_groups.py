"""A process makes the groups of one shape of the world once (ParallelContext.of_world): a warm worker
running a sweep's configs one after another, or a test job a hundred, keeps no idle gloo groups, each
of which polls its sockets while it lives (docs/development.md#the-budget)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tpbench.config import RunConfig
from tpbench.experiments.setup import context
from tpbench.parallel.context import ParallelContext

pytestmark = pytest.mark.quick
CPU = torch.device("cpu")


@pytest.fixture
def world():
    def init() -> None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    init()
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_shape_of_the_world_gets_its_groups_once_and_each_call_a_fresh_context(world):
    first = ParallelContext.of_world(1, 1, CPU)
    again = ParallelContext.of_world(1, 1, CPU)
    assert again is not first  # a context of its own (setup_kv_replicas sets a field of it)
    assert (again.tp_group, again.dp_group, again.mesh) == (first.tp_group, first.dp_group, first.mesh)
    other = ParallelContext.of_world(1, 1, CPU, timedelta(seconds=7))  # groups made with another timeout
    assert other.tp_group is not first.tp_group
    # every experiment's context comes from it
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1))
    timeout = timedelta(seconds=cfg.launch.collective_timeout_s)
    assert context(cfg).tp_group is ParallelContext.of_world(1, 1, CPU, timeout).tp_group


def test_a_new_default_group_gets_new_groups(world):
    first = ParallelContext.of_world(1, 1, CPU)
    dist.destroy_process_group()  # as an emulated rank's measurement does; its groups die with it
    world()
    assert ParallelContext.of_world(1, 1, CPU).tp_group is not first.tp_group


# --- one mesh per layout: its groups made once, each waiting tpbench's timeout ----------------------

TIMEOUT = timedelta(seconds=7)


@pytest.fixture
def world8(monkeypatch):
    """Rank 0 of a world of 8 on torch's fake backend (an emulated rank's: tpbench.parallel.emulation),
    and every group made in it counted."""
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    made = []
    new_group = c10d._new_group_with_tag
    monkeypatch.setattr(c10d, "_new_group_with_tag", lambda *a, **k: made.append(a[0]) or new_group(*a, **k))
    yield made
    dist.destroy_process_group()


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _timeout(group: dist.ProcessGroup) -> timedelta:
    return group._get_backend(CPU).options._timeout


def test_a_layout_s_second_run_gets_the_very_same_mesh_and_groups(world8):
    """TP 2 x DP 4, and HSDP's (replicate 2 x shard 2) x TP 2 with one KV head replicated on both TP
    ranks: a later run of each layout makes no group, and gets the same mesh, sub-meshes and groups."""
    first = ParallelContext.of_world(2, 4, CPU, TIMEOUT)
    hsdp = ParallelContext.of_world(2, 4, CPU, TIMEOUT, dp_replicate=2)
    hsdp.setup_kv_replicas(1)
    made = len(world8)
    again = ParallelContext.of_world(2, 4, CPU, TIMEOUT)
    hsdp_again = ParallelContext.of_world(2, 4, CPU, TIMEOUT, dp_replicate=2)
    hsdp_again.setup_kv_replicas(1)
    assert len(world8) == made  # no group made
    assert first.with_replicas(2).mesh is hsdp.mesh and hsdp.with_replicas(1).mesh is first.mesh
    for a, b in ((first, again), (hsdp, hsdp_again)):
        for field in ("mesh", "tp_mesh", "fsdp_mesh", "tp_group", "dp_group"):
            assert getattr(a, field) is getattr(b, field), field
    assert hsdp_again.kv_replica_group is hsdp.kv_replica_group
    # HSDP's mesh is the layout's (dp, tp) with its dp unflattened: the same TP and DP groups
    assert (hsdp.tp_group, hsdp.dp_group) == (first.tp_group, first.dp_group)
    assert hsdp.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert hsdp.fsdp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert hsdp.tp_mesh.get_group() is first.tp_group and first.fsdp_mesh.get_group() is first.dp_group
    # rank 0's groups: rank = (r * 2 + s) * tp + t
    assert (_ranks(first.tp_group), _ranks(first.dp_group)) == ([0, 1], [0, 2, 4, 6])
    replicate, shard = hsdp.fsdp_mesh.get_group("dp_replicate"), hsdp.fsdp_mesh.get_group("dp_shard")
    assert (_ranks(replicate), _ranks(shard), _ranks(hsdp.kv_replica_group)) == ([0, 4], [0, 2], [0, 1])
    for group in (first.tp_group, first.dp_group, replicate, shard, hsdp.kv_replica_group):
        assert _timeout(group) == TIMEOUT


def test_every_group_waits_tpbench_s_timeout_on_gloo(world):
    """The groups a real backend makes for the mesh carry the collective timeout (torch's DeviceMesh
    would give them its default, 30 minutes)."""
    ctx = ParallelContext.of_world(1, 1, CPU, TIMEOUT)
    assert dist.get_backend(ctx.tp_group) == "gloo"
    assert [_timeout(g) for g in (ctx.tp_group, ctx.dp_group)] == [TIMEOUT, TIMEOUT]
