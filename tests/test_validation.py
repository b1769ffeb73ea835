"""Validation's criterion (tpbench.experiments.criterion): a correct model passes on other seeds, and
each planted bug fails it, naming the check and the parameter.

Every config below runs through validate.run in test_parallel's world-2 torchrun job (tests/torchrun_checks.py
`WORLD2`); the benchmarks/validation_grid.py grid (docs/results/validation.md) runs the many seeds and shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from beside import beside
from torchrun_checks import TINY, WORLD2, per_config, run_config

from tpbench.config import RunConfig
from tpbench.experiments.criterion import CHECKS, Verdict, verdicts
from tpbench.experiments.planted import SCALED
from tpbench.experiments.signs import mend_rounded_signs
from tpbench.experiments.validate import count_beside
from tpbench.results import ParamRow
from tpbench.run import compose

TP_SP_VP = ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"]
SEEDS = {f"seed_{s}": [*TP_SP_VP, f"train.seed={s}"] for s in (1, 2, 3)}
PLANTED = {  # each must fail
    "rope_offset": ["parallel.tp=2", "debug.validate_fault=rope_offset"],
    "no_backward_sum": ["parallel.tp=2", "debug.validate_fault=no_backward_sum"],
    "no_backward_sum_sp": [*TP_SP_VP, "debug.validate_fault=no_backward_sum"],
    "grad_scale_fp32": ["parallel.tp=2", "debug.grad_scale=1.05"],
    "grad_scale_bf16": ["parallel.tp=2", "train.dtype=bfloat16", "debug.grad_scale=1.1"],
}
# bf16 under launch.bf16_gemm=fp32_accumulate (tests/test_validation_gemm.py: the GEMMs themselves)
BF16_GEMM = {"bf16_gemm": [*TP_SP_VP, "train.dtype=bfloat16", "launch.bf16_gemm=fp32_accumulate"]}
BF16_GEMM["grad_scale_bf16_gemm"] = [*PLANTED["grad_scale_bf16"], "launch.bf16_gemm=fp32_accumulate"]


# --- the torchrun job: test_parallel's world-2 job (tests/torchrun_checks.py WORLD2) ----------------

WORLD2.add("validate", "validation", {name: TINY + o for name, o in (SEEDS | PLANTED | BF16_GEMM).items()})


@beside
def validated(folder: Path) -> dict:
    """Rank 0's results per config: its figures reduced over the job, its failed checks' lines and its
    parameters' rows (what the database records); and every rank's count of the elements the sign
    rule mended."""
    ranks = per_config(WORLD2.part(folder, "validate", "validation"))
    return {name: each[0] | {"rounded": [r["rounded"] for r in each]} for name, each in ranks.items()}


# --- the assertions ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*SEEDS, *PLANTED, *BF16_GEMM])
def test_the_sign_rule_writes_the_gradients_where_the_step_reads_them(validated, name):
    """write_gradients of a TP model (both engines' configs here): every gradient doubled, read back
    doubled (then restored), on every rank."""
    assert validated[name]["write_gradients_error"] == 0.0


@pytest.mark.parametrize("name", SEEDS)
def test_other_seeds_pass_with_their_own_rounding_measured(validated, name):
    """Each check's worst item within its bound, the reference (the dense model in fp64) not 0."""
    r = validated[name]
    assert r["failed"] == [] and r["metrics"]["passed"] == 1.0
    for check, *_ in CHECKS:
        assert r["metrics"][f"{check}_of_bound"] <= 1, check
    # fp32 against fp64: measured (not 0), and under each check's floor
    floors = {
        "dense_fwd_logits_max_abs": 1e-5,
        "dense_grad_max_rel_l2": 1e-5,
        "dense_adamw_param_max_rel_l2": 1e-3,
    }
    for own, floor in floors.items():
        assert 0 < r["metrics"][own] < floor, own


def test_bf16_with_its_gemms_fp32_accumulated_passes_with_bf16_rounding(validated):
    """Every GEMM of the run (sharded, dense, forward and backward) went through the switch, and the
    dense model is still a bf16 one: its own error against the fp32 reference at bf16's scale."""
    r = validated["bf16_gemm"]
    assert r["failed"] == [] and r["metrics"]["passed"] == 1.0
    assert r["metrics"]["bf16_gemms_fp32_accumulated"] > 0
    assert 1e-3 < r["metrics"]["dense_grad_max_rel_l2"] < 0.1


def test_a_wrong_rope_offset_fails_the_forward(validated):
    r = validated["rope_offset"]
    assert r["metrics"]["passed"] == 0.0 and r["metrics"]["fwd_logits_max_abs"] > 1e-3
    assert r["failed"][0].startswith("fwd_logits_max_abs ")


@pytest.mark.parametrize("name", ["no_backward_sum", "no_backward_sum_sp"])
def test_a_missing_backward_collective_fails_the_gradients_not_the_forward(validated, name):
    r = validated[name]
    assert r["metrics"]["fwd_logits_max_abs_of_bound"] <= 1  # forward untouched
    assert r["metrics"]["passed"] == 0.0
    assert any(f.startswith("grad_rel_l2 model.") for f in r["failed"])


@pytest.mark.parametrize("name", ["grad_scale_fp32", "grad_scale_bf16", "grad_scale_bf16_gemm"])
def test_one_gradient_scaled_fails_naming_that_parameter(validated, name):
    """A relative error of 5% (fp32) and 10% (bf16, and bf16 with its GEMMs fp32-accumulated) in one
    gradient: the failure names the parameter, its figure and its bound, K x the dense model's own
    error + the floor."""
    r = validated[name]
    scale = 0.05 if name.endswith("fp32") else 0.1
    value, reference = r["params"][SCALED]
    assert value == pytest.approx(scale, rel=0.3)
    assert r["metrics"]["passed"] == 0.0
    (failure,) = [f for f in r["failed"] if f.startswith("grad_rel_l2")]
    assert failure.startswith(f"grad_rel_l2 {SCALED} {value:.3g} > bound ")
    assert f"(4 x {reference:.3g} + 1e-05)" in failure


def test_the_elements_mended_are_counted_over_all_ranks(validated):
    """adamw_rounded_signs is the total over the ranks of the elements the sign rule mended, not
    the worst rank's count (bf16: each rank mends some)."""
    r = validated["grad_scale_bf16"]
    assert min(r["rounded"]) > 0
    assert r["metrics"]["adamw_rounded_signs"] == sum(r["rounded"])


def test_the_bound_is_k_times_the_reference_plus_the_floor():
    v = Verdict("grad_rel_l2", "", "w", value=0.05, reference=0.01, floor=1e-5, k=4.0)
    assert v.bound == pytest.approx(0.04001) and not v.ok and v.of_bound == pytest.approx(0.05 / 0.04001)
    assert v.failure() == "grad_rel_l2 w 0.05 > bound 0.04 (4 x 0.01 + 1e-05)"
    assert Verdict("loss_abs_diff", "", "", value=1e-6, reference=0.0, floor=1e-5).ok  # under the floor


def test_a_per_parameter_check_reports_the_parameter_nearest_its_bound_not_the_largest():
    """A noisy parameter loosens no other's bound: b (0.01 against its own 1e-4) fails, though a
    (0.05 against its own 0.02) is larger."""
    rows = [
        ParamRow("a", "column", [2], 0, 0, 0.05, 0.02, 0, 0, 0),
        ParamRow("b", "column", [2], 0, 0, 0.01, 1e-4, 0, 0, 0),
    ]
    figures = dict.fromkeys(
        (c for check in CHECKS for c in (check[0], check[3]) if c is not None),
        0.0,
    )
    grads = next(v for v in verdicts(run_config([]), figures, rows) if v.check == "grad_rel_l2")
    assert (grads.param, grads.ok) == ("b", False)


class _Unsharded:
    """A parallel model as validate's checks take one, holding the whole of each parameter."""

    def __init__(self, module):
        self.module = module

    def shard_like(self, name, dense):
        return dense.detach()

    def full_gradients(self):
        return {n: p.grad for n, p in self.module.named_parameters()}

    def write_gradients(self, grads):
        for name, grad in grads.items():
            self.full_gradients()[name].copy_(grad)

    def full_parameters(self):
        return {n: p.detach() for n, p in self.module.named_parameters()}


def test_the_elements_whose_gradient_sign_rounding_decided_step_with_the_dense_gradient():
    """Issue 34's false failures: an element whose gradient is within rounding of 0 has the other sign
    in the sharded model, so AdamW would move it lr the other way, and its momentum on; it steps with
    the dense model's gradient instead. An element whose gradient differs by more than rounding (a
    bug's) keeps its own."""
    import torch

    models = [torch.nn.Linear(8, 1, bias=False) for _ in range(3)]  # sharded, dense, reference
    grad = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, 1e-3]])
    sharded = grad * torch.tensor([1, 1, 1, 1, 1, 1, -1, -1])
    for m, g in zip(models, (sharded, grad, grad + 1e-3), strict=True):
        m.weight.grad = g.clone()
    rounded = {"weight": torch.zeros(1, 8, dtype=torch.bool)}
    mend_rounded_signs(run_config([]), _Unsharded(models[0]), models[1], models[2], rounded)
    assert rounded["weight"].tolist() == [[False] * 7 + [True]]  # element 6's flip is 2, not rounding
    assert models[0].weight.grad[0].tolist() == pytest.approx([1, -1, 1, -1, 1, -1, -1, 1e-3])


def test_an_element_rounding_set_near_adamws_eps_steps_with_the_dense_gradient_though_its_sign_agrees():
    """AdamW's first step moves an element by lr x g / (|g| + 1e-8): the tiny model's layer-0 q_norm
    under precision=mixed (T 2, SP's gather in the linear, seed 0, a Xeon with AMX) took 1.2e-8 where
    the dense model took 1.3e-5, both within rounding of 0, and stepped 0.54 lr against 1 lr: 1.64
    of its bound, a false failure. Within rounding of 0 rounding decides the sign, flipped or not,
    so the element steps with the dense gradient; one as near 0 but off by more than rounding (a
    bug's) keeps its own."""
    import torch

    models = [torch.nn.Linear(8, 1, bias=False) for _ in range(3)]  # sharded, dense, reference
    grad = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.3e-5, 1.3e-5]])
    sharded = grad.clone()
    sharded[0, 6], sharded[0, 7] = 1.2e-8, 0.5  # rounding's; a bug's
    for m, g in zip(models, (sharded, grad, grad + 1e-5), strict=True):
        m.weight.grad = g.clone()
    steps = []
    for g in (sharded, grad):
        w = torch.zeros(1, 8, requires_grad=True)
        w.grad = g.clone()
        torch.optim.AdamW([w], lr=1.0, weight_decay=0.0).step()
        steps.append(-float(w.detach()[0, 6]))
    assert steps == pytest.approx([0.54, 1.0], abs=0.01)  # what rounding alone would have done
    rounded = {"weight": torch.zeros(1, 8, dtype=torch.bool)}
    mend_rounded_signs(run_config([]), _Unsharded(models[0]), models[1], models[2], rounded)
    assert rounded["weight"].tolist() == [[False] * 6 + [True, False]]
    assert models[0].weight.grad[0, 6:].tolist() == pytest.approx([1.3e-5, 0.5])


def test_the_rounding_per_element_is_over_the_elements_the_gradient_touched():
    """An embedding's rows of tokens no batch held have gradient 0 in every model: counted in the rms,
    they spread a row's rounding thin, and a flip that rounding decided in a row seen once went on
    (issue 34's Llama shape, seed 8: the embedding at 1.08 of its bound)."""
    import torch

    models = [torch.nn.Embedding(100, 4) for _ in range(3)]  # sharded, dense, reference
    grad = torch.zeros(100, 4)
    grad[0], grad[1] = torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([1.0, -1.0, 1.0, 1e-3])
    flipped = grad.clone()
    flipped[1, 3] = -1e-3  # 2e-3 off: within the touched elements' rounding (4 x 1e-3 rms)
    for m, g in zip(models, (flipped, grad, grad + (grad != 0) * 1e-3), strict=True):
        m.weight.grad = g.clone()
    rounded = {"weight": torch.zeros(100, 4, dtype=torch.bool)}
    mend_rounded_signs(run_config([]), _Unsharded(models[0]), models[1], models[2], rounded)
    assert rounded["weight"].nonzero().tolist() == [[1, 3]]


def test_an_elements_rounding_is_its_rows_and_its_columns():
    """A weight's gradient element sums dy[t, o] x[t, i] over the tokens: its rounding scales with its
    row and its column. Issue 34's Llama shape at T 4, seed 8: token 485's embedding row carried 30x
    the shard's rms gradient; one of its elements flipped by 3.7e-6, 3.4 of the row's own rounding
    but 4.6 of the shard's rms, and went on (the run FAILED). A flip as large in a row that rounds
    10x less is a bug's, and keeps its own gradient."""
    import torch

    models = [torch.nn.Embedding(10, 4) for _ in range(3)]  # sharded, dense, reference
    grad = torch.tensor([[1.0, -1.0, 1.0, 1e-4]] * 2 + [[0.0] * 4] * 8)
    error = torch.zeros(10, 4)
    error[0], error[1] = 1e-3, 1e-4  # row 0 rounds 10x more than row 1
    flipped = grad.clone()
    flipped[0, 3] = flipped[1, 3] = -2.9e-3  # 3e-3 off in both rows
    for m, g in zip(models, (flipped, grad, grad + error), strict=True):
        m.weight.grad = g.clone()
    rounded = {"weight": torch.zeros(10, 4, dtype=torch.bool)}
    mend_rounded_signs(run_config([]), _Unsharded(models[0]), models[1], models[2], rounded)
    # row 0 allows 4 x 1e-3, row 1 4 x 1e-4; the parameter's rms (7.1e-4) would allow 2.8e-3 in both
    assert rounded["weight"].nonzero().tolist() == [[0, 3]]
    assert models[0].weight.grad[:2, 3].tolist() == pytest.approx([1e-4, -2.9e-3])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["validate.k=-1"], "validate.k=-1.0: accepted are finite numbers >= 0"),
        (["debug.grad_scale=0"], "debug.grad_scale=0.0 with kind=validate: scales one gradient"),
        (["kind=memory", "debug.grad_scale=1.05"], "debug.grad_scale=1.05 with kind=memory: scales"),
        (["debug.validate_fault=no_backward_sum", "parallel.engine=dtensor"], "with parallel.engine=dtensor"),
        (["debug.validate_fault=wrong"], "debug.validate_fault"),
    ],
)
def test_bad_validation_settings_are_refused_before_launch(overrides, message):
    with pytest.raises(compose.ConfigError, match=re.escape(message)):
        compose.expand(["kind=validate", "tp=2", *overrides])


def test_runs_beside_one_dense_model_are_consecutive_ones_of_one_dense_side_up_to_the_cap():
    """validate.count_beside: the configs a warm worker validates as one (tpbench.run.worker): consecutive,
    the same dense side (the parallel model's settings may differ, the seed may not), at most
    launch.share_dense of them; another kind, or share_dense 1, alone."""

    def config(seed: int = 0, sp: bool = False, share: int = 4, kind: str = "validate") -> RunConfig:
        cfg = RunConfig(kind=kind)
        cfg.train.seed, cfg.parallel.sp, cfg.launch.share_dense = seed, sp, share
        return cfg

    runs = [config(), config(sp=True), config(), config(seed=1), config(seed=1, sp=True), config()]
    assert [count_beside(runs, i) for i in (0, 3, 5)] == [3, 2, 1]
    assert count_beside([config(share=2)] * 3, 0) == 2
    assert count_beside([config(share=1)] * 3, 0) == 1
    assert count_beside([config(kind="memory")] * 3, 0) == 1
