"""Rank emulation (tpbench.parallel.emulation): one process standing in for rank r of a job gives that rank's
memory and collectives byte for byte, with real tensors and with fake ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from beside import beside
from torch._subclasses.fake_tensor import FakeTensorMode
from torchrun_checks import FAMILIES, WORLD2, WORLD4, peaks_told, per_config, run_config

from tpbench.config import RunConfig
from tpbench.experiments import memory
from tpbench.parallel import emulation
from tpbench.predict import allocator, theory
from tpbench.predict.allocator import CachingAllocator, replay
from tpbench.run import compose

SMALL = [
    "kind=memory",
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.vocab_size=510",  # padded under VP at T = 4: the last rank is the busiest there
    "train.seq_len=64",
    "train.dtype=bfloat16",
    "train.steps=1",
    "train.warmup=1",
]
# One launch of world 4: T = 2 as dp 2 x tp 2, T = 4, and DDP over 4 ranks
DP2 = ["parallel.tp=2", "parallel.dp=2"]
MODES = {
    "ddp": ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=4"],
    "t2_tp": DP2,
    "t2_tp_sp": [*DP2, "parallel.sp=true"],
    "t2_tp_vp": [*DP2, "parallel.vp=true"],
    "t2_tp_sp_vp": [*DP2, "parallel.sp=true", "parallel.vp=true"],
    "t4_tp": ["parallel.tp=4"],
    "t4_tp_sp": ["parallel.tp=4", "parallel.sp=true"],
    "t4_tp_vp": ["parallel.tp=4", "parallel.vp=true"],
    "t4_tp_sp_vp_kv1": [
        "parallel.tp=4",
        "parallel.sp=true",
        "parallel.vp=true",
        "model.num_key_value_heads=1",
    ],
    "t4_dtensor_tp_sp": ["parallel.tp=4", "parallel.engine=dtensor", "parallel.sp=true"],
    # the families: Qwen2.5's biases with its 2 KV heads replicated at T 4; Llama without q/k norms
    "t4_qwen25_tp_sp_vp": ["parallel.tp=4", "parallel.sp=true", "parallel.vp=true", *FAMILIES["qwen25"]],
    "t2_llama_tp_vp": [*DP2, "parallel.vp=true", *FAMILIES["llama"]],
}


WORLD4.add("memory", "emulation", {name: SMALL + overrides for name, overrides in MODES.items()})


@beside
def real_job(folder: Path) -> dict:
    """Every rank's peak and collectives in a real torchrun job (gloo, 4 processes: test_theory's)."""
    return per_config(WORLD4.part(folder, "memory", "emulation"))


def emulate(name: str, flavour: str, rank: int | None) -> dict:
    cfg = run_config([*SMALL, *MODES[name], f"launch.emulate={flavour}"])
    cfg.launch.emulate_rank = rank
    result = memory.measure_in_process(cfg)
    return {
        "peak": next(m.value for m in result.measurements if m.name == "peak_bytes"),
        "comm": sorted([c.op, c.purpose, c.count, c.bytes] for c in result.comm),
        "rank": result.rank,
    }


@pytest.mark.parametrize("name", MODES)
def test_real_tensors_give_every_rank_of_the_job_byte_for_byte(real_job, name):
    for rank, measured in enumerate(real_job[name]):
        emulated = emulate(name, "real", rank)
        assert emulated["rank"] == rank
        assert emulated["peak"] == measured["peak"], f"rank {rank}\n{peaks_told(real_job[name])}"
        assert emulated["comm"] == measured["comm"], f"rank {rank}"


@pytest.mark.parametrize("name", ["t2_tp_sp_vp", "t4_tp_vp", "t4_tp_sp_vp_kv1", "t4_qwen25_tp_sp_vp"])
def test_fake_tensors_give_the_same_bytes(real_job, name):
    rank = emulation.emulated_rank(run_config([*SMALL, *MODES[name]]))
    emulated = emulate(name, "fake", None)
    assert emulated["rank"] == rank
    assert emulated["peak"] == real_job[name][rank]["peak"]
    assert emulated["comm"] == real_job[name][rank]["comm"]


@pytest.mark.parametrize("name", MODES)
def test_the_default_rank_is_the_busiest(real_job, name):
    peaks = [r["peak"] for r in real_job[name]]
    busiest = emulation.emulated_rank(run_config([*SMALL, *MODES[name]]))
    assert peaks[busiest] == max(peaks), peaks_told(real_job[name])


def test_a_padded_vocab_makes_no_rank_busier(real_job):
    padded = real_job["t4_tp_vp"]  # 510 rows pad to 512: rank 3 masks its padded logits, in place
    assert len({r["peak"] for r in padded}) == 1, peaks_told(padded)
    assert emulation.emulated_rank(run_config([*SMALL, *MODES["t4_tp_vp"]])) == 0
    assert len({r["peak"] for r in real_job["t4_tp_sp"]}) == 1, peaks_told(real_job["t4_tp_sp"])


def gpu_config(overrides: list[str]) -> RunConfig:
    cfg = run_config([*SMALL, *overrides, "launch.emulate=fake"])
    return dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, device="cuda"))


@pytest.mark.parametrize("name", ["ddp", "t2_tp_sp_vp"])
def test_an_emulated_gpu_rank_matches_the_model_and_reports_the_allocator(name):
    cfg = gpu_config([*MODES[name], "parallel.ddp_gradient_as_bucket_view=false", "train.loss=logits_mean"])
    result = {m.name: m.value for m in memory.measure_in_process(cfg).measurements}
    assert result["peak_bytes"] == theory.predict(cfg).peak_bytes  # to the byte, as on the CPU
    workspaces = 2 * 32 * 2**20  # H100: two cuBLAS workspaces of 32 MiB
    assert result["modelled_max_memory_allocated_bytes"] >= result["peak_bytes"] + workspaces
    assert result["modelled_max_memory_reserved_bytes"] >= result["modelled_max_memory_allocated_bytes"]
    # the analytic model learns the device: its max allocated (the live peak and the workspaces) against
    # the emulated allocator's, which rounds and splits blocks on top (without the workspaces: 64 MiB off)
    predicted = result["predicted_max_memory_allocated_bytes"]
    assert predicted <= result["modelled_max_memory_allocated_bytes"] <= 1.1 * predicted


# torchtitan's published FSDP runs (issue 38), cut to 2 layers: one emulated GPU rank of Llama 3.1 70B at
# FSDP 32 x TP 8, micro-batch 16, full activation checkpointing, and of Llama 3.1 8B at FSDP 8,
# micro-batch 2, selective recompute; S 8192, bf16 mixed (FSDP2's MixedPrecisionPolicy)
TORCHTITAN = {
    "llama3_70b_fsdp32_tp8": [
        "model=llama3_70b",
        "mode=tp_sp_vp",
        "tp=8",
        "dp=32",
        "micro_batch=16",
        "recompute=full",
    ],
    "llama3_8b_fsdp8": ["model=llama3_8b", "tp=1", "dp=8", "micro_batch=2", "recompute=selective"],
}


@pytest.mark.parametrize("name", TORCHTITAN)
def test_torchtitans_fsdp_runs_cut_to_two_layers_match_the_model(name):
    from tpbench.run import sweep

    shape = ["layers=2", "seq=8192", "dp_shard=full", "precision=mixed", "dtype=bfloat16", "kind=memory"]
    emulated = ["launch.device=cuda", "launch.emulate=fake"]
    (cfg,) = sweep.configs([*TORCHTITAN[name], *shape, *emulated], single=True, launching=False)
    measured, _ = memory.measure_busiest(cfg)
    assert measured["peak_bytes"] == theory.predict(cfg).peak_bytes  # to the byte


def test_a_gpu_is_known_by_its_device_name():
    names = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200", "NVIDIA A100-SXM4-80GB": "A100"}
    assert {name: allocator.gpu_of(name) for name in names} == names
    assert allocator.gpu_of("NVIDIA A10") == "A10" and allocator.gpu_of("NVIDIA GeForce RTX 4090") is None


def test_allocator_rounds_splits_and_keeps_whole_blocks():
    a = CachingAllocator()
    small = a.malloc(100)  # rounds to 512 in a new 2 MiB segment
    assert (a.allocated, a.reserved) == (512, 2 << 20)
    big = a.malloc(3 << 20)  # a 20 MiB segment, split: 17 MiB remain
    assert (a.allocated, a.reserved) == (512 + (3 << 20), (2 << 20) + (20 << 20))
    a.free(big)
    whole = a.malloc((20 << 20) - (512 << 10))  # 512 KiB would remain: not split, the block counts whole
    assert a.allocated == 512 + (20 << 20)
    a.free(whole)
    a.free(small)
    assert a.allocated == 0 and a.reserved == (22 << 20)  # segments are kept
    peaks = replay([("alloc", 0, 5 << 20), ("window",), ("free", 0), ("alloc", 1, 1 << 20)], "A100")
    assert peaks.allocated == 5 << 20  # the window starts from what is held


def _ops(x: torch.Tensor, w: torch.Tensor, rate: float = 0.5) -> list[torch.Tensor]:
    """Ops whose cached outputs depend on each fact of their arguments: views (the offset they
    start at), in-place ops (which argument they return), dtypes, strides, requires_grad; and ops with
    lists of tensors in or out (AdamW's foreach ops, split: FakeTensorMode caches none of those out);
    an in-place foreach op with a list of floats (AdamW's bias corrections: other numbers each step)."""
    a, b = x[1:], x[:-1]  # same shape and strides, other offsets
    outs = [a.view(-1), b.view(-1), a @ w, x.t() @ x, x.to(torch.bfloat16), x.t().contiguous()]
    outs += [x.clone().add_(1.0), torch.empty(3, 4, requires_grad=True) * 2, x.sum(0), x.sum(1)]
    outs += [*torch._foreach_sqrt([a, w.t()]), *torch._foreach_mul([b, x], 2.0)]
    outs += [torch.cat([a, b[:2]]), *a.split([1, 3]), *b.split([1, 3]), *x.t().unbind(0)]  # views
    kept = [x.clone(), w.clone()]
    torch._foreach_addcmul_(kept, [x, w], [x, w], value=0.5)  # in place: returns nothing
    torch._foreach_addcdiv_(kept, [x, w], [x, w], [rate, rate / 2])
    return outs + kept


def _facts(t: torch.Tensor) -> tuple:
    state = {k: v for k, v in vars(t).items() if k != "fake_mode"}  # FakeTensor.__new__'s attributes
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes(), t.requires_grad,
            type(t), t.device, t._is_view(), state)  # fmt: skip


def test_fake_rank_makes_what_fake_tensor_mode_makes_and_caches_by_quick_key(monkeypatch):
    with FakeTensorMode():
        x, w = torch.empty(5, 5), torch.empty(5, 2)
        expected = [_facts(t) for t in _ops(x, w)]
    rank = emulation.FakeRank()
    seen: list = []
    with rank, rank.observed_by(lambda func, out: seen.append(func)):
        x, w = torch.empty(5, 5), torch.empty(5, 2)
        start = len(seen)
        first = [_facts(t) for t in _ops(x, w)]
        step = torch.tensor(3.0)  # a constant, as AdamW's step counters are: FakeTensorMode keeps its value
        middle = len(seen)

        def no_full_keys(*args, **kwargs):
            raise AssertionError("FakeTensorMode's own key was built again")

        def no_dispatch(*args, **kwargs):
            raise AssertionError("an op ran again rather than coming from the cache")

        handed_back: list = []  # ops that FakeTensorMode's entry turns into an output on a hit

        def from_entry(state, entry, key, func, args):
            handed_back.append(func)
            return FakeTensorMode._output_from_cache_entry(rank, state, entry, key, func, args)

        monkeypatch.setattr(rank, "_cache_key", no_full_keys)
        monkeypatch.setattr(rank, "_dispatch_impl", no_dispatch)
        monkeypatch.setattr(rank, "_output_from_cache_entry", from_entry)
        second = [_facts(t) for t in _ops(x, w, rate=0.25)]
        end = len(seen)
        assert step.item() == 3.0  # answered from the constant, without FakeTensorMode's dispatch
    assert first == expected and second == expected
    assert seen[start : middle - 1] == seen[middle:end] and torch.ops.aten.mm.default in seen  # once each
    assert seen[end:] == [torch.ops.aten._local_scalar_dense.default]  # observers see item() too
    # new tensors and views are made by FakeRank's recipes; only ops that return an argument are not
    in_place = {"add_.Tensor", "_foreach_addcmul_.Scalar", "_foreach_addcdiv_.ScalarList"}
    assert {f.__name__ for f in handed_back} == in_place


# Full recompute at a real model's shape, cut in layers: issue 35's fit row (Llama 3 70B, T 8, SP and VP,
# micro-batch 16, seq 8192) on an emulated H100, and its neighbours. Its peak is block 1's forward made
# again in its backward, at the SwiGLU's product; without SP, the post-attention norm's backward over the
# whole [S, B, H] (theory.blocks.recomputed_swiglu, recomputed_post_attention_norm).
REAL_SHAPE = [
    "model=llama3_70b",
    "layers=2",
    "seq=8192",
    "micro_batch=16",
    "tp=8",
    "kind=memory",
    "steps=1",
    "train.warmup=1",
    "launch.device=cuda",
    "launch.emulate=fake",
    "launch.emulate_gpu=H100-80GB",
]
AT_REAL_SHAPE = {
    "full_sp_vp": ["sp=true", "vp=true", "recompute=full", "precision=pure"],
    "full_vp_mixed": ["vp=true", "recompute=full", "precision=mixed"],
    "selective_sp_vp": ["sp=true", "vp=true", "recompute=selective", "precision=pure"],
    "none_sp_vp": ["sp=true", "vp=true", "recompute=none", "precision=pure"],
}
SPLIT = ("params", "grads", "optimizer", "activations", "temporaries")


@pytest.mark.parametrize("name", AT_REAL_SHAPE)
def test_recompute_at_a_real_models_shape_is_predicted_to_the_byte_by_category(name):
    (cfg,) = compose.expand([*REAL_SHAPE, *AT_REAL_SHAPE[name]], launching=False)
    measured = {m.name: m.value for m in memory.measure_in_process(cfg).measurements}
    predicted = theory.predict(cfg)
    assert measured["peak_bytes"] == predicted.peak_bytes
    split = predicted.breakdown()
    assert [measured[f"mem_{k}_bytes"] for k in SPLIT] == [split[f"mem_{k}_bytes"] for k in SPLIT]


# the same moments at the tiny shape, in test_parallel's world-2 job: every rank measured
TINY_FULL = [*SMALL, "model.vocab_size=512", "parallel.tp=2", "parallel.vp=true", "train.recompute=full"]
RECOMPUTED = {
    "full_vp": (TINY_FULL, "recomputed post-attention norm 0"),
    "full_vp_mixed_b8": ([*TINY_FULL, "train.precision=mixed", "train.micro_batch=8"], "recomputed swiglu 1"),
}
WORLD2.add("memory", "recomputed", {name: overrides for name, (overrides, _) in RECOMPUTED.items()})


@beside
def recomputed_job(folder: Path) -> dict:
    return per_config(WORLD2.part(folder, "memory", "recomputed"))


@pytest.mark.parametrize("name", RECOMPUTED)
def test_full_recomputes_norm_and_swiglu_moments_are_measured_at_the_tiny_shape(recomputed_job, name):
    overrides, moment = RECOMPUTED[name]
    predicted = theory.predict(run_config(overrides))
    assert predicted.peak.name == moment
    assert [rank["peak"] for rank in recomputed_job[name]] == [predicted.peak_bytes] * 2


def test_an_emulated_rank_of_the_dtensor_engine_traces_its_parameters_local_shards():
    """The allocation trace takes a DTensor parameter by its local shard: the wrapper's own storage,
    which holds nothing, reports the whole tensor's bytes, and the replay of a DTensor step held every
    parameter at its global size (108 to 135 MiB over the H200's allocator at the seed's L 8 shape,
    docs/results/gpu-check.md)."""
    from torch.distributed.tensor import DTensor

    from tpbench.experiments.setup import context
    from tpbench.experiments.training import Trainer

    dtensor = ["parallel.tp=4", "parallel.engine=dtensor", "parallel.sp=true", "parallel.vp=true"]
    cfg = gpu_config([*dtensor, "model.vocab_size=512"])
    emulation.init_process_group(cfg)
    try:
        trace, adopted = emulation.AllocationTrace(), []

        def on_device(module: torch.nn.Module) -> None:  # as memory.run adopts them
            adopted.extend(module.parameters())
            trace.adopt(adopted)

        with emulation.tensor_mode(cfg):
            Trainer(cfg, context(cfg), on_device)
        local = {id(s): s.nbytes() for s in (p.to_local().untyped_storage() for p in adopted)}
        assert any(isinstance(p, DTensor) for p in adopted)
        assert sum(e[2] for e in trace.events if e[0] == "alloc") == sum(local.values())
        assert sum(local.values()) < sum(p.untyped_storage().nbytes() for p in adopted)  # the global bytes
    finally:
        torch.distributed.destroy_process_group()


def test_dtensors_shape_inference_is_no_rank_memory_on_fake_tensors():
    """DTensor's loss_parallel infers its backward's output shape by running the op at the global
    shape (ShardingPropagator._propagate_tensor_meta_non_cached): beside real tensors in a fresh
    FakeTensorMode, which no tracker sees; under a FakeRank it ran in the FakeRank, and the tracker
    counted two fp32 [N, V] (127,880 B over the model here). A fake rank's peak is the model's now."""
    cfg = run_config([*SMALL, "model.vocab_size=512", "parallel.tp=2", "parallel.vp=true",
                      "parallel.engine=dtensor", "train.dtype=float32", "launch.emulate=fake"])  # fmt: skip
    peak = next(m.value for m in memory.measure_in_process(cfg).measurements if m.name == "peak_bytes")
    assert peak == theory.predict(cfg).peak_bytes
