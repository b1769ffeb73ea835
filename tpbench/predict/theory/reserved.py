"""What the CUDA caching allocator reserves beyond the live tensors, for any config without running it:
the predicted max reserved of `plan` and `fit` (issue 59 item 4).

    reserved = default stream's peak + cuBLAS workspaces + FSDP2's stream pools

  default stream's  the model's live bytes (exact on the CPU) at the moment where they are most once
  peak              the bytes FSDP2 holds on its own streams are taken out (`Moment.streams`): the
                    gradient shards made so far and the flat all-gather outputs alive. Without
                    FSDP2: the live peak (`Prediction.peak_bytes`)
  cuBLAS workspaces two, allocated at the first GEMMs and held (tpbench.predict.allocator)
  stream pools      FSDP2 (parallel.dp_shard grads or full) allocates on streams of its own, and the
                    allocator keeps a block in the pool of the stream it was made on: the default
                    stream never reuses those bytes. Its all-gather copy-in stream holds each unit's
                    flat all-gather output (the gathered weights, in the compute dtype) and, under
                    mixed precision, the input cast from its fp32 shard; each output is kept until the
                    next unit's copy-in (its AllGatherState), so two are alive at once. Its
                    reduce-scatter stream holds each unit's reduce-scatter output: the sharded
                    gradients (fp32 under mixed precision), kept until the next step's zero_grad.
                    Their reserve is the allocator model's (tpbench.predict.allocator: its rounding,
                    segment sizes and block splitting) over that schedule of FSDP2's (torch 2.13
                    _fsdp_collectives.foreach_all_gather, foreach_reduce), two steps, forward's
                    gathers of the root then the blocks, backward's (full: resharded after forward)
                    of the blocks top down, the reduce-scatters of the blocks top down then the root.

Not in it: the default stream's own fragmentation (blocks cached but too small, or split, for what the
step asks later), which only the replay of an emulated step's allocations tells (`plan --measure`); nor
the whole TP-local model tpbench's trainer places on the device before FSDP2 shards it (torchtitan
builds on the meta device and materialises the shards). A cast shard alive at a moment (the
copy-in's input, freed within its copy-in) is counted twice, in the moment's bytes and in its pool.
Checked against the replay in docs/results/fit.md ("Reserved bytes"): 0.5-7.0% under it with
expandable segments, 1.7-50.7% under the default allocator's, on five rows.
Non-sharded levels (DDP, ZeRO-1: tpbench's own buckets, on the default stream) reserve the live peak and
the workspaces here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tpbench.config import RunConfig
from tpbench.predict.allocator import CUBLAS_HANDLES, CachingAllocator, cublas_workspace_bytes
from tpbench.predict.theory import Prediction, sharding
from tpbench.predict.theory.dims import Dims
from tpbench.predict.theory.shards import ROOT, unit_shards

COPY_IN, REDUCE_SCATTER = 1, 2  # the streams' numbers, as the allocation trace numbers FSDP2's


@dataclass(frozen=True)
class Reserved:
    """A config's predicted max reserved bytes on a GPU, by what holds them."""

    live: int  # the model's live peak
    default: int  # the default stream's peak: the live bytes less FSDP2's pools', at their largest
    workspaces: int  # the cuBLAS workspaces
    all_gather: int  # FSDP2's copy-in stream's pool
    reduce_scatter: int  # FSDP2's reduce-scatter stream's pool

    @property
    def total(self) -> int:
        return self.default + self.workspaces + self.all_gather + self.reduce_scatter


def fsdp_stream_pools(cfg: RunConfig) -> tuple[int, int]:
    """Reserved bytes of FSDP2's copy-in and reduce-scatter streams' pools (0, 0 unless FSDP2)."""
    s = sharding.sharding(cfg)
    if not s.fsdp:
        return 0, 0
    return _stream_pools(sharding.level_dims(cfg), s)


@functools.cache
def _stream_pools(d: Dims, s: sharding.Sharding) -> tuple[int, int]:
    """The allocator model over FSDP2's schedule of its own streams' allocations (the module's
    docstring), two steps. Cached: fit asks for each Dims many times (both are frozen)."""
    c = sharding.computing(d, s)
    shards = unit_shards(d, s.D)
    blocks = [u for u in shards if u != ROOT]
    gathers = [ROOT, *blocks] + (blocks[::-1] if s.level == "full" else [])
    allocator = CachingAllocator()
    grads: list = []
    for _ in range(2):  # the first step makes the pools, the second reuses them
        for block in grads:  # zero_grad(set_to_none): last step's sharded gradients
            allocator.free(block)
        held = None  # the previous unit's flat output, kept until this unit's copy-in is done
        for u in gathers:
            cast = allocator.malloc(shards[u] * c.w, COPY_IN) if d.mixed else None
            out = allocator.malloc(s.D * shards[u] * c.w, COPY_IN)
            if cast is not None:
                allocator.free(cast)
            if held is not None:
                allocator.free(held)
            held = out
        allocator.free(held)  # the root's post-forward (or the last backward unit) lets it go
        grads = [allocator.malloc(shards[u] * d.w, REDUCE_SCATTER) for u in [*blocks[::-1], ROOT]]
    return allocator.stream_reserved.get(COPY_IN, 0), allocator.stream_reserved.get(REDUCE_SCATTER, 0)


def reserved(cfg: RunConfig, prediction: Prediction, gpu: str) -> Reserved:
    """The predicted max reserved of `cfg` on `gpu` (its `prediction`: `theory.predict`'s)."""
    all_gather, reduce_scatter = fsdp_stream_pools(cfg)
    default = max(m.total - m.streams for m in prediction.moments)
    workspaces = CUBLAS_HANDLES * cublas_workspace_bytes(gpu)
    return Reserved(prediction.peak_bytes, default, workspaces, all_gather, reduce_scatter)
