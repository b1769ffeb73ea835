"""Reserved bytes under sharded DP (issue 59 item 4): the allocation trace of an emulated GPU rank takes
FSDP2's storage resizes as frees and allocations and tells its streams apart; the allocator model keeps a
pool per stream."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchrun_checks import run_config

from tpbench.experiments import memory
from tpbench.parallel import emulation
from tpbench.predict.allocator import replay

# the tiny model (H 64, L 2, V 256, S 32) on an emulated H100 rank of FSDP 2, bf16 mixed precision
TINY = [
    "kind=memory",
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.vocab_size=256",
    "train.seq_len=32",
    "train.steps=1",
    "train.warmup=1",
    "train.precision=mixed",
    "train.dtype=bfloat16",
    "parallel.tp=1",
    "parallel.dp=2",
    "launch.emulate=fake",
    "launch.emulate_gpu=H100",
]
WORKSPACES = 2 * 32 * 2**20  # two cuBLAS workspaces of 32 MiB on an H100


def gpu_config(overrides: list[str]):
    cfg = run_config([*TINY, *overrides])
    return dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, device="cuda"))


def traced(cfg) -> tuple[dict[str, float], list[tuple]]:
    """The emulated rank's measurements and the allocation trace the allocator model replayed."""
    seen: list[list[tuple]] = []
    original = memory.allocator.replay

    def keep(events, gpu, expandable=False):
        seen.append(events)
        return original(events, gpu, expandable)

    memory.allocator.replay = keep
    try:
        result = {m.name: m.value for m in memory.measure_in_process(cfg).measurements}
    finally:
        memory.allocator.replay = original
    return result, seen[0]


def test_a_storage_resized_to_nothing_is_a_free_and_back_up_an_allocation():
    trace = emulation.AllocationTrace()
    mode = emulation.FakeRank()
    before = vars(torch.UntypedStorage).get("resize_")  # a MemTracker before may have left its own
    with mode, mode.observed_by(trace.observe), trace.resizes():
        gathered = torch.empty(3 << 20, dtype=torch.bfloat16)  # 6 MiB, as FSDP2's all-gather output
        storage = gathered.untyped_storage()
        for _ in range(3):  # FSDP2's free_storage, then alloc_storage for the next gather
            storage.resize_(0)
            storage.resize_(6 << 20)
        storage.resize_(0)
        empty = torch.empty(0)
        empty.untyped_storage().resize_(1024)  # made empty before: its first bytes are an allocation
    assert [e[0] for e in trace.events] == ["alloc"] + ["free", "alloc"] * 4
    assert vars(torch.UntypedStorage).get("resize_") is before  # the class as it was
    peaks = replay(trace.events, "H100")
    # one 6 MiB block at a time, in the one 20 MiB segment (four, were the resizes not seen), and the
    # 1 KiB tensor's 2 MiB one
    assert (peaks.allocated, peaks.reserved) == (6 << 20, (20 << 20) + (2 << 20))


def test_a_block_serves_only_its_own_streams_allocations():
    trace = emulation.AllocationTrace()
    mode = emulation.FakeRank()
    side = torch.cpu.Stream()
    with mode, mode.observed_by(trace.observe):
        with torch.cpu.stream(side):
            a = torch.empty(12 << 20, dtype=torch.uint8)  # 12 MiB on the side stream
        del a
        b = torch.empty(12 << 20, dtype=torch.uint8)  # the same size on the default stream
    assert [e[3] for e in trace.events if e[0] == "alloc"] == [1, 0]
    peaks = replay(trace.events, "H100")
    assert peaks.reserved == 2 * (12 << 20)  # a segment each: the freed block is not the default's
    one_stream = [e[:3] if e[0] == "alloc" else e for e in trace.events]
    assert replay(one_stream, "H100").reserved == 12 << 20  # were it one pool: b takes a's block
    del b


def test_fsdp2s_gathered_weights_are_freed_in_the_replay():
    """The replay's max allocated less the workspaces is the live peak and the allocator's rounding
    (+1.1% on the tiny model); FSDP2's resharded weights, were their `resize_(0)` not frees, would stay
    allocated (+12%: every unit's gathered weights at once)."""
    result, events = traced(gpu_config(["parallel.dp_shard=full"]))
    live, allocated = result["peak_bytes"], result["modelled_max_memory_allocated_bytes"]
    assert live <= allocated - WORKSPACES <= 1.02 * live, (live, allocated - WORKSPACES)


def test_fsdp2s_streams_are_told_apart_in_the_trace():
    """FSDP2 allocates its all-gather input and output on its copy-in stream and its reduce-scatter
    output (the sharded gradients) on its reduce-scatter stream; the rest on the default stream. On
    the tiny model at FSDP 2, bf16 mixed: per unit (2 blocks and the root), the gathered bf16 weights
    and their bf16 shard on the first, the fp32 gradient shard on the second."""
    cfg = gpu_config(["parallel.dp_shard=full"])
    _, events = traced(cfg)
    by_stream: dict[int, list[int]] = {}
    for e in events:
        if e[0] == "alloc":
            by_stream.setdefault(e[3], []).append(e[2])
    assert sorted(by_stream) == [0, 1, 2]
    from tpbench.experiments.setup import build_dense

    dense = build_dense(dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, device="cpu")))
    block = sum(p.numel() for p in dense.model.layers[0].parameters())  # every dim even: no padding
    units = {block, sum(p.numel() for p in dense.parameters()) - len(dense.model.layers) * block}
    assert set(by_stream[1]) == {2 * n for n in units} | {2 * n // 2 for n in units}  # gathered, shard
    assert set(by_stream[2]) == {4 * n // 2 for n in units}  # the fp32 gradient shards
    assert len(by_stream[2]) == 2 * (len(dense.model.layers) + 1)  # a unit's a step (warm-up, measured)


def fsdp_mem_tracker_peak(cfg) -> tuple[dict[str, int], int]:
    """torch's FSDPMemTracker's peak by its categories over one step of the emulated rank (fake
    tensors on the CPU, the fake process group: fake CUDA tensors run no backward on a CPU-only
    torch, tpbench.parallel.emulation), after a warm-up step; and AdamW's step counters' bytes (on the
    host on a GPU: the model leaves them out, FSDPMemTracker counts them as OptState here)."""
    import gc

    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from tpbench.experiments.training import Trainer

    emulation.init_process_group(cfg)
    try:
        ctx = memory.context(cfg)
        with emulation.tensor_mode(cfg):
            trainer = Trainer(cfg, ctx)
            trainer.step()
            adamw = getattr(trainer.optimizer, "adamw", trainer.optimizer)
            tracker = FSDPMemTracker(trainer.module, adamw)
            gc.collect()
            with tracker:
                trainer.step()
            counters = sum(s["step"].untyped_storage().nbytes() for s in adamw.state.values())
            (peak,) = tracker.get_tracker_snapshot("peak").values()
    finally:
        dist.destroy_process_group()
    return {str(k).removeprefix("_FSDPRefType."): v for k, v in peak.items()}, counters


@pytest.mark.parametrize("level", ["full", "grads"])
def test_fsdp_mem_trackers_categories_are_the_models_terms(level):
    """Each of FSDPMemTracker's categories at its peak against the model's terms at its peak moment
    (tpbench.predict.theory.sharding.split), FSDP 2 on the tiny model, bf16 mixed:
      weights       Sharded Param + Unsharded Param (FSDP2's fp32 shards, the gathered bf16 weights)
      master        Sharded Param
      moments       OptState less AdamW's step counters (on the host on a GPU)
      activations   Activation + Inputs; at ZeRO-2's loss forward also All Gather (the last block's
                    flat all-gather output, which FSDP2 keeps until the next gather's copy-out)
      gradients     Sharded Grad + Unsharded Grad; under full, at its peak in backward, also the
                    root's bf16 final-norm gradient, which FSDPMemTracker counts as Temp until the
                    root's post-backward tags it
      temporaries   the rest of Temp, All Gather (a block's flat gather) and Reduce Scatter (a block's
                    fp32 reduce-scatter input)
    and the totals equal to the byte."""
    from tpbench.predict import theory
    from tpbench.predict.theory import sharding

    cfg = gpu_config([f"parallel.dp_shard={level}"])
    peak, counters = fsdp_mem_tracker_peak(cfg)
    predicted = theory.predict(cfg)
    terms = sharding.split(predicted.dims, sharding.sharding(cfg), predicted.peak)
    assert peak["Total"] - counters == predicted.peak_bytes
    assert terms["weights"] == peak["SHARDED_PARAM"] + peak["UNSHARDED_PARAM"]
    assert terms["master"] == peak["SHARDED_PARAM"]
    assert terms["moments"] == peak["OPT"] - counters
    norm_grad = cfg.model.hidden_size * 2  # bf16
    if level == "full":
        assert predicted.peak.name == "next block all-gather"
        assert terms["activations"] == peak["ACT"] + peak["INP"]
        assert terms["gradients"] == peak["SHARDED_GRAD"] + peak["UNSHARDED_GRAD"] + norm_grad
        assert terms["temporaries"] == peak["TEMP"] - norm_grad + peak["ALL_GATHER"] + peak["REDUCE_SCATTER"]
        assert peak["ALL_GATHER"] > 0 and peak["REDUCE_SCATTER"] == 2 * peak["ALL_GATHER"]  # fp32, bf16
    else:
        assert predicted.peak.name == "loss forward"
        assert terms["activations"] == peak["ACT"] + peak["INP"] + peak["ALL_GATHER"]
        assert terms["gradients"] == peak["SHARDED_GRAD"] + peak["UNSHARDED_GRAD"] == 0
        assert terms["temporaries"] == peak["TEMP"] + peak["REDUCE_SCATTER"] == 0


@pytest.mark.parametrize("level", ["full", "grads"])
def test_fsdp2s_stream_pools_are_predicted_as_the_trace_replays_them(level):
    """tpbench.predict.theory.reserved derives FSDP2's copy-in and reduce-scatter streams' reserves from
    FSDP2's schedule through the allocator model; the replay of the emulated step's own allocations
    on those streams reserves the same bytes (the 8B row at FSDP 8: 2,676 and 3,894 MiB both ways)."""
    from tpbench.predict import allocator, theory
    from tpbench.predict.theory import reserved

    # H 512, V 8192: each unit's gather (5-8 MiB) in the large pool, where the schedule shows
    wider = ["model.hidden_size=512", "model.vocab_size=8192"]
    cfg = gpu_config([f"parallel.dp_shard={level}", *wider])
    result, events = traced(cfg)
    model = allocator.CachingAllocator()
    live = {}
    for e in events:
        if e[0] == "alloc":
            live[e[1]] = model.malloc(e[2], e[3])
        elif e[0] == "free" and e[1] in live:
            model.free(live.pop(e[1]))
    traced_pools = (model.stream_reserved[1], model.stream_reserved[2])
    assert reserved.fsdp_stream_pools(cfg) == traced_pools
    predicted = reserved.reserved(cfg, theory.predict(cfg), "H100")
    assert predicted.total == result["predicted_max_memory_reserved_bytes"]
    assert predicted.total == predicted.default + WORKSPACES + sum(traced_pools)


def test_expandable_segments_map_pages_at_the_segments_end():
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's launch): one segment a pool,
    grown by 20 MiB pages at its end, joined to a free last block; the default allocator makes a
    segment per request that no cached block fits."""
    from tpbench.predict.allocator import CachingAllocator

    MiB = 1 << 20
    for expandable, reserved in ((True, [40, 60, 100, 100]), (False, [30, 56, 92, 182])):
        a = CachingAllocator(expandable=expandable)
        x = a.malloc(30 * MiB)  # expandable: 2 pages, a 10 MiB free end
        seen = [a.reserved]
        y = a.malloc(25 * MiB)  # the free end and 1 page more
        seen.append(a.reserved)
        a.free(x)  # a 30 MiB hole: too small for the next
        z = a.malloc(35 * MiB)  # the 5 MiB free end and 2 pages
        seen.append(a.reserved)
        a.free(y)
        a.free(z)  # expandable: one free block of 100 MiB, which the next fits in
        a.malloc(90 * MiB)
        seen.append(a.reserved)
        assert seen == [r * MiB for r in reserved], expandable
