"""tpbench's collectives call torch.distributed's current API: no FutureWarning (torch 2.13 deprecates
all_gather_into_tensor and reduce_scatter_tensor for all_gather_single and reduce_scatter_single), so
`fit --measure` and the tests print none. On torch's fake backend, world 2, in this one process."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tpbench.parallel import collectives


@pytest.fixture
def group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_no_collective_warns(group):
    x = torch.ones(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test, FutureWarning above all
        assert collectives.all_gather(x, group, "t").shape == (8, 3)
        assert collectives.all_gather_async(x, group, "t").wait().shape == (8, 3)
        assert collectives.reduce_scatter(x, group, "t").shape == (2, 3)
        assert collectives.reduce_scatter_async(x, group, "t").wait().shape == (2, 3)
        assert collectives.all_reduce(x, group, "t").shape == (4, 3)
