"""launch.bf16_gemm=fp32_accumulate (tpbench.models.gemm): bf16 GEMMs computed as fp32
accumulation rounded once to bf16, what a GPU's bf16 GEMM computes, at fp32 speed on a CPU without
bf16 units. In process: the GEMM itself, a tiny model's loss and gradients against native bf16, and
the refusals. The validation run under the switch rides in test_parallel's world-2 job
(tests/test_validation.py `bf16_gemm`)."""

from __future__ import annotations

import copy
import re
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpbench.models.gemm import GEMMS, bf16_gemms
from tpbench.models.minimind import MiniMindConfig, build_model
from tpbench.run import compose

EPS = 2.0**-7  # bf16's machine epsilon: one ulp at 1


class _Seen(TorchDispatchMode):
    """Counts the GEMMs that reach aten by their input dtypes (entered outside bf16_gemms, it sees
    the GEMMs the switch runs in its place)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.dtypes[args[-1].dtype] += 1
        return func(*args, **(kwargs or {}))


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, mode: str) -> tuple[torch.Tensor, Counter]:
    with _Seen() as seen, bf16_gemms(mode):
        return torch.nn.functional.linear(a, b, bias), seen.dtypes


def test_a_gemm_is_the_fp32_product_rounded_once_one_ulp_from_native_at_most():
    gen = torch.Generator().manual_seed(0)
    a, b, bias = (torch.randn(*s, generator=gen).bfloat16() for s in ((96, 512), (80, 512), (80,)))
    (native, seen_native), (emulated, seen) = (_gemm(a, b, bias, m) for m in ("native", "fp32_accumulate"))
    assert seen_native == Counter({torch.bfloat16: 1}) and seen == Counter({torch.float32: 1})
    assert emulated.dtype == torch.bfloat16
    # exactly the fp32 product rounded once
    exact = torch.addmm(bias.float(), a.float(), b.float().t())
    assert torch.equal(emulated, exact.bfloat16())
    # native bf16 (oneDNN here) sums in its own order: equal but for a few elements, one ulp apart
    diff = (emulated.float() - native.float()).abs()
    assert (diff == 0).float().mean() > 0.99
    assert (diff <= native.float().abs() * EPS).all()


@pytest.fixture(scope="module")
def tiny_runs():
    """The tiny model (SDPA attention as the default tiny, and the manual attention of the seed's
    check), one forward and backward in bf16: native, under the switch (with what GEMMs reached
    aten), and in fp32."""
    out = {}
    for flash in (True, False):
        cfg = MiniMindConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
            flash_attn=flash,
        )  # fmt: skip
        base = build_model(cfg, seed=0)
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
        runs = (("native", torch.bfloat16), ("fp32_accumulate", torch.bfloat16), ("native", torch.float32))
        for mode, dtype in runs:
            model = copy.deepcopy(base).to(dtype)
            with _Seen() as seen, bf16_gemms(mode) as switch:
                loss = model(ids, ids)[1]
                loss.backward()
            grads = {n: p.grad.float() for n, p in model.named_parameters()}
            out[flash, mode, dtype] = loss.float().item(), grads, seen.dtypes, switch
    return out


@pytest.mark.parametrize("flash", [True, False])
def test_a_model_under_the_switch_runs_every_gemm_in_fp32(tiny_runs, flash):
    """Forward and backward: every GEMM native ran in bf16 reaches aten in fp32 under the switch."""
    native = tiny_runs[flash, "native", torch.bfloat16][2]
    _, _, seen, switch = tiny_runs[flash, "fp32_accumulate", torch.bfloat16]
    assert native[torch.bfloat16] > 0 and native[torch.float32] == 0
    assert seen == Counter({torch.float32: native[torch.bfloat16]})
    assert switch.count == native[torch.bfloat16]


@pytest.mark.parametrize("flash", [True, False])
def test_a_model_under_the_switch_equals_native_bf16_to_its_rounding(tiny_runs, flash):
    """The loss within one bf16 ulp of native's; the gradients together within a relative L2 of
    bf16's epsilon of native's, and each nearer native than native is to fp32 (the error validation
    measures). One parameter's own relative figure can pass epsilon: k_norm's gradient, a sum over
    every position of rounded products, was 1.03 epsilon from native's on a Xeon whose bf16 GEMMs
    run on AMX, and 0.42 of native's own error against fp32."""
    loss, grads, *_ = tiny_runs[flash, "native", torch.bfloat16]
    loss_e, grads_e, *_ = tiny_runs[flash, "fp32_accumulate", torch.bfloat16]
    _, grads_32, *_ = tiny_runs[flash, "native", torch.float32]
    assert abs(loss_e - loss) <= abs(loss) * EPS
    total = torch.cat([g.flatten() for g in grads.values()])
    off = torch.cat([(grads_e[n] - g).flatten() for n, g in grads.items()])
    own = torch.cat([(grads_32[n] - g).flatten() for n, g in grads.items()])
    assert 0 < off.norm() / total.norm() < EPS
    assert off.norm() < own.norm()
    for name, g in grads.items():
        assert (grads_e[name] - g).norm() < (grads_32[name] - g).norm(), name


def test_mixed_precision_under_the_switch_runs_the_autocast_gemms_in_fp32():
    """precision=mixed: fp32 weights, forward under autocast to bf16; the switch takes the GEMMs
    autocast made bf16 (forward and backward) and leaves the gradients within bf16's epsilon."""
    cfg = MiniMindConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
        flash_attn=False,
    )  # fmt: skip
    base = build_model(cfg, seed=0)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in ("native", "fp32_accumulate"):
        model = copy.deepcopy(base)
        with _Seen() as seen, bf16_gemms(mode):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids, ids)[1]
            loss.backward()
        out[mode] = {n: p.grad for n, p in model.named_parameters()}, seen.dtypes
    (grads, native), (grads_e, seen) = out["native"], out["fp32_accumulate"]
    assert native[torch.bfloat16] > 0 and seen == Counter({torch.float32: sum(native.values())})
    for name, g in grads.items():
        assert 0 <= (grads_e[name] - g).norm() <= EPS * g.norm() + 1e-30, name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.dtype=float32"], "launch.bf16_gemm=fp32_accumulate with train.dtype=float32: it computes"),
        (
            ["train.dtype=float16", "train.precision=mixed"],
            "launch.bf16_gemm=fp32_accumulate with train.dtype=float16",
        ),
        (["kind=throughput", "train.dtype=bfloat16"], "fp32_accumulate with kind=throughput: it emulates"),
        (["launch.bf16_gemm=fp64"], "launch.bf16_gemm='fp64': accepted are 'native', 'fp32_accumulate'"),
        (
            ["train.dtype=bfloat16", "launch.device=cuda", "launch.emulate=fake", "kind=memory"],
            "launch.bf16_gemm=fp32_accumulate with kind=memory",
        ),
    ],
)
def test_the_switch_is_refused_where_it_changes_nothing_or_slows_a_measurement(overrides, message):
    with pytest.raises(compose.ConfigError, match=re.escape(message)):
        compose.expand(["kind=validate", "tp=2", "launch.bf16_gemm=fp32_accumulate", *overrides])


def test_the_switch_is_refused_on_cuda_where_native_is_right():
    (cfg,) = compose.expand(
        ["kind=validate", "tp=2", "train.dtype=bfloat16", "launch.bf16_gemm=fp32_accumulate"]
    )
    cfg.launch.device = "cuda"
    cfg.launch.slurm.gpus_per_node, cfg.launch.launcher = 2, "slurm"
    with pytest.raises(compose.ConfigError, match=re.escape("with launch.device=cuda: a GPU's bf16 GEMM")):
        compose.resolve_device(cfg)


def test_the_estimate_and_the_slow_kernel_line_count_its_gemms_as_fp32():
    from tpbench.predict import rate_probe
    from tpbench.sizing import estimate

    (native,) = compose.expand(["kind=validate", "tp=2", "train.dtype=bfloat16"])
    (emulated,) = compose.expand(
        ["kind=validate", "tp=2", "train.dtype=bfloat16", "launch.bf16_gemm=fp32_accumulate"]
    )
    flops = estimate.executed_flops(native)
    assert set(flops) == {"bfloat16", "float32"}
    assert estimate.executed_flops(emulated) == {"float32": pytest.approx(sum(flops.values()))}
    assert rate_probe.slow_kernel_line("bfloat16", emulated, 1) is None


def test_the_slow_kernel_line_of_a_native_bf16_validation_names_the_switch(monkeypatch):
    from tpbench.predict import rate_probe

    monkeypatch.setattr(
        rate_probe, "rate", lambda dtype, cfg, threads: {"float32": 82e9, "bfloat16": 0.4e9}[dtype]
    )
    (validate,) = compose.expand(["kind=validate", "tp=2", "train.dtype=bfloat16"])
    (memory,) = compose.expand(["kind=memory", "tp=2", "train.dtype=bfloat16"])
    assert "to validate bf16: launch.bf16_gemm=fp32_accumulate" in rate_probe.slow_kernel_line(
        "bfloat16", validate, 1
    )
    assert "bf16_gemm" not in rate_probe.slow_kernel_line("bfloat16", memory, 1)


def test_a_run_under_the_switch_is_described_so():
    from tpbench.config import emulation_label

    assert emulation_label({"launch.bf16_gemm": "fp32_accumulate"}) == "bf16 GEMMs fp32-accumulated"
    assert emulation_label({"launch.bf16_gemm": "native"}) == emulation_label({}) == ""
