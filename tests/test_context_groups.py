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
