"""The collectives of tensor, sequence and vocab parallelism, as conjugate autograd pairs.

| public function                   | forward        | backward       | paper |
|-----------------------------------|----------------|----------------|-------|
| copy_to_tp_region                 | identity       | all-reduce     | f     |
| reduce_from_tp_region             | all-reduce     | identity       | f-bar |
| gather_from_sp_region             | all-gather d0  | reduce-scatter | g     |
| reduce_scatter_to_sp_region       | reduce-scatter | all-gather d0  | g-bar |
| scatter_to_sp_region              | split d0       | all-gather d0  |       |
| gather_from_sp_region_replicated  | all-gather d0  | split d0       |       |

The last two pair a replicated region with the sequence-sharded stream (replicated embedding into SP,
SP into a replicated LM head). Every op is the identity for a group of one. Each is a private autograd
class behind its public function; their collectives are `tpbench.parallel.collectives`' (counted as
"activation"). Below them, SP's shard-keeping hooks: `saving_only_shard` saves a gathered input for
backward as its shard, and a `Regather` gathers it again when backward needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from tpbench.parallel.collectives import (
    Group,
    Pending,
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    group_size,
    reduce_scatter,
    reduce_scatter_async,
)


def split(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's shard of dim 0; no communication. A copy: a view would keep all of `x` alive."""
    world = group_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=0)[dist.get_rank(group)].clone()


# --- conjugate autograd pairs ------------------------------------------------------------------


class Meanwhile(Protocol):
    """Compute a region's entry backward runs while its collective is in flight (parallel.overlap):
    tpbench.parallel.overlap.DeferredWeightGrads."""

    wait: bool  # False only to show that validation catches a gradient read before its sum lands

    def run(self) -> None: ...


def _overlapped(pending: Pending, unreduced: torch.Tensor | None, meanwhile: Meanwhile) -> torch.Tensor:
    meanwhile.run()
    result = pending.wait()
    return result if meanwhile.wait else unreduced


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meanwhile):
        ctx.group, ctx.meanwhile = group, meanwhile
        return x

    @staticmethod
    def backward(ctx, grad):  # a copy: autograd may hand the same gradient to other nodes too
        if ctx.meanwhile is None:
            return all_reduce(grad.clone(), ctx.group, "activation"), None, None
        unreduced = None if ctx.meanwhile.wait else grad.clone()
        pending = all_reduce_async(grad.clone(), ctx.group, "activation")
        return _overlapped(pending, unreduced, ctx.meanwhile), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # in place, as Megatron: x is a row-parallel layer's partial sum that nothing saves (were it
        # saved, its bumped version counter would make that backward fail, never silently differ)
        return all_reduce(x, group, "activation")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meanwhile, site):
        ctx.group, ctx.meanwhile = group, meanwhile
        return all_gather(x, group, "activation", site)

    @staticmethod
    def backward(ctx, grad):
        if ctx.meanwhile is None:
            return reduce_scatter(grad, ctx.group, "activation"), None, None, None
        unreduced = None if ctx.meanwhile.wait else split(grad, ctx.group)
        pending = reduce_scatter_async(grad, ctx.group, "activation")
        return _overlapped(pending, unreduced, ctx.meanwhile), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, "activation")

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, "activation"), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, "activation"), None


class _GatherFromSPReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, "activation")

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: Group, meanwhile: Meanwhile | None = None) -> torch.Tensor:
    """f: identity forward, all-reduce backward. Entering a column-parallel region. With `meanwhile`,
    backward launches the all-reduce, runs `meanwhile` and only then waits for it."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group, meanwhile)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f-bar: all-reduce forward, identity backward. Leaving a row-parallel region."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sp_region(
    x: torch.Tensor, group: Group, meanwhile: Meanwhile | None = None, site: str = ""
) -> torch.Tensor:
    """g: all-gather dim 0 forward, reduce-scatter backward. SP shard [S/T] -> TP region [S]. With
    `meanwhile`, backward launches the reduce-scatter, runs `meanwhile` and only then waits for it.
    `site` tells apart entries that gather the same shard (see `all_gather`)."""
    return x if group_size(group) == 1 else _GatherFromSP.apply(x, group, meanwhile, site)


def reduce_scatter_to_sp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g-bar: reduce-scatter dim 0 forward, all-gather backward. TP partial sums [S] -> SP shard [S/T]."""
    return x if group_size(group) == 1 else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Split dim 0 forward, all-gather backward. A replicated [S] tensor -> its SP shard [S/T]."""
    return x if group_size(group) == 1 else _ScatterToSP.apply(x, group)


def gather_from_sp_region_replicated(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather dim 0 forward, split backward. SP shard -> a replicated consumer (full LM head)."""
    return x if group_size(group) == 1 else _GatherFromSPReplicated.apply(x, group)


# --- SP: keep the shard, gather again in backward ----------------------------------------------


class Regather:
    """Stands in, in the autograd graph, for a gathered [S, B, H] input saved for backward. Holds
    only the local shard; the first backward use all-gathers it again and the rest share that copy."""

    def __init__(self, shard: torch.Tensor, group: Group):
        self.shard = shard.detach()
        self.group = group
        self.full: torch.Tensor | None = None
        self.pending: Pending | None = None

    def prefetch(self) -> None:
        """Launch the all-gather now; the first use waits for it (parallel.overlap)."""
        if self.full is None and self.pending is None:
            self.pending = all_gather_async(self.shard, self.group, "regather")

    def get(self) -> torch.Tensor:
        if self.full is None:
            self.full = (
                self.pending.wait()
                if self.pending is not None
                else all_gather(self.shard, self.group, "regather")
            )
            self.pending = None
        return self.full


@contextlib.contextmanager
def saving_only_shard(full: torch.Tensor, shard: torch.Tensor, group: Group) -> Iterator[Regather | None]:
    """Inside, any tensor saved for backward that is (a view of) `full` is saved as the `shard`
    and re-gathered in backward: the paper's TP+SP activation memory (Korthikanti et al. 4.2.2).
    Yields the re-gather, whose `prefetch()` starts it early."""
    if group_size(group) == 1:
        yield None
        return
    # the hooks live as long as the graph: they must not hold `full` itself, or nothing is saved
    storage, dtype = full.untyped_storage()._cdata, full.dtype  # a fake tensor has no data_ptr
    token = Regather(shard, group)

    def pack(t: torch.Tensor):
        if t.untyped_storage()._cdata == storage and t.dtype == dtype:
            return token, t.shape, t.stride(), t.storage_offset()
        return t

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        tok, shape, stride, offset = packed
        return tok.get().as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield token
