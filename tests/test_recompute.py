"""Activation recompute (train.recompute): the same numbers, the predicted collectives and FLOPs, one
torchrun launch of the tiny model at T = 2 (DDP at dp = 2) for every mode and setting, on each engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from beside import beside
from torchrun_checks import FAMILIES, TINY, WORLD2, run_config, same_on_every_rank

from tpbench.models.minimind import RMSNorm, swiglu
from tpbench.predict import theory

MODES = {
    "ddp": ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=2"],
    "tp": ["parallel.tp=2"],
    "tp_sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp_vp": ["parallel.tp=2", "parallel.vp=true"],
    "tp_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
    # Qwen2.5: q, k, v biases, head_dim 16 (q and o Nq D = 2 H wide), no q/k norms
    "qwen25_tp_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true", *FAMILIES["qwen25"]],
    # DTensor's engine: its functional collectives, which op's policy keeps (reduce-scatter) or
    # recomputes (all-gather, all-reduce); selective calls its RowwiseParallel down_proj's hooks
    "dtensor_tp": ["parallel.engine=dtensor", "parallel.tp=2"],
    "dtensor_tp_sp_vp": ["parallel.engine=dtensor", "parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
}
SETTINGS = ("none", "selective", "full", "op")
BASE = [*TINY, "validate.steps=2", "validate.every=1", "train.warmup=0"]


def overrides(name: str) -> list[str]:
    mode, setting = name.split("/")
    return [*BASE, *MODES[mode], f"train.recompute={setting}"]


NAMES = [f"{mode}/{setting}" for mode in MODES for setting in SETTINGS]


WORLD2.add("recompute", "recompute", {name: overrides(name) for name in NAMES})  # test_parallel's job


@beside
def checked(folder: Path) -> dict:
    ranks = WORLD2.part(folder, "recompute", "recompute")
    return same_on_every_rank(ranks)  # the diffs and FLOPs reduced over the job, the collectives alike


@pytest.mark.parametrize("name", NAMES)
def test_validation_passes_with_every_setting(checked, name):
    assert checked[name]["passed"] == 1.0


@pytest.mark.parametrize("name", [n for n in NAMES if not n.endswith("/none")])
def test_recompute_is_bit_exact_against_none(checked, name):
    """Manual attention, gloo on CPU: every op is deterministic, so recompute changes no bit."""
    assert checked[name]["loss_diff"] == 0.0
    assert checked[name]["param_diff"] == 0.0


def calls(name: str, row: list) -> list:
    """[op, purpose, count, bytes]; the dtensor engine sums each replicated gradient on its own, which
    the model counts as one all-reduce of their bytes: the count of its gradient sums left out."""
    op, purpose, count, size = row
    return [op, purpose, None if name.startswith("dtensor") and purpose == "grad_sum" else count, size]


@pytest.mark.parametrize("name", NAMES)
def test_collectives_are_the_predicted_ones(checked, name):
    """The recomputation's own collectives among them (the purpose "recompute"): under full every
    entry and the attention's exit; under op, on tpbench's engine none (its policy keeps every one of
    its collectives), on DTensor's the all-gathers (or the attention exit's all-reduce)."""
    predicted = sorted(
        calls(name, [r.op, r.purpose, r.count, r.bytes])
        for r in theory.predict(run_config(overrides(name))).rows
    )
    assert sorted(calls(name, row) for row in checked[name]["comm"]) == predicted


@pytest.mark.parametrize("name", NAMES)
def test_recompute_adds_the_predicted_flops(checked, name):
    mode = name.split("/")[0]
    extra = checked[name]["flops"] - checked[f"{mode}/none"]["flops"]
    assert extra == theory.recompute_flops_per_step(run_config(overrides(name)))
    assert (extra > 0) == name.endswith(("/full", "/op"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_keeps_gate_and_up_only_and_changes_no_bit(dtype):
    """The model's silu-mul remakes silu(gate) in backward instead of keeping it (none's saving)."""
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(64, 96, generator=gen, dtype=dtype) for _ in range(3))
    gate.requires_grad_(), up.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused = swiglu(gate, up)
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up
    plain = F.silu(gate) * up
    assert torch.equal(fused, plain)
    fused_grads = torch.autograd.grad(fused, (gate, up), grad)
    plain_grads = torch.autograd.grad(plain, (gate, up), grad)
    assert all(torch.equal(a, b) for a, b in zip(fused_grads, plain_grads, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rmsnorm_changes_no_bit(dtype):
    """model.lean_rmsnorm remakes the norm's fp32 internals in backward: the same ops, the same bits
    (its memory is the analytic model's, checked against MemTracker in tests/test_theory.py)."""
    gen = torch.Generator().manual_seed(0)
    x, grad = (torch.randn(32, 2, 96, generator=gen, dtype=dtype) for _ in range(2))
    results = []
    for lean in (True, False):
        norm = RMSNorm(96, keep_input_only=lean).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(96, generator=gen.manual_seed(1)))
        xi = x.clone().requires_grad_()
        out = norm(xi)
        results.append([out, *torch.autograd.grad(out, (xi, norm.weight), grad)])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
