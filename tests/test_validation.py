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
from tpbench.experiments.dense_side import count_beside
from tpbench.experiments.planted import HEAD, ROW, SCALED
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
BF16, MIXED = ["train.dtype=bfloat16"], ["train.dtype=bfloat16", "train.precision=mixed"]
CORRECT = {"bf16": [*TP_SP_VP, *BF16], "mixed": [*TP_SP_VP, *MIXED]}  # pass, and their bounds give the
# smallest factor a row's error needs to fail
LATE = {  # debug.from_step: each planted bug acts from step 5 of 6 (torchrun_checks.TINY)
    "skip_sp_norms_from_5": [*TP_SP_VP, "debug.skip_grad_sum=[sp_norms]", "debug.from_step=5"],
    "grad_scale_from_5": ["parallel.tp=2", "debug.grad_scale=1.05", "debug.from_step=5"],
    "row_scale_from_5": [*TP_SP_VP, "debug.row_grad_scale=1.05", "debug.from_step=5"],
    "head_scale_from_5": ["parallel.tp=2", "debug.head_grad_scale=1.05", "debug.from_step=5"],
}
LOCAL = {  # one row's or one head's error too small for the whole parameter's relative L2 in fp32
    "row_fp32": [*TP_SP_VP, "model.vocab_size=1024", "debug.row_grad_scale=1.0001"],
    "head_fp32": ["parallel.tp=2", "debug.head_grad_scale=1.0001"],
}
ADVERTISED = {  # issue 55 item 1: "down to 0.002% in fp32, 5% in bf16 and mixed"
    "advertised_fp32": ["parallel.tp=2", "debug.grad_scale=1.00002"],
    "advertised_bf16": ["parallel.tp=2", *BF16, "debug.grad_scale=1.05"],
    "advertised_mixed": ["parallel.tp=2", *MIXED, "debug.grad_scale=1.05"],
}
# bf16 under launch.bf16_gemm=fp32_accumulate (tests/test_validation_gemm.py: the GEMMs themselves)
BF16_GEMM = {"bf16_gemm": [*TP_SP_VP, "train.dtype=bfloat16", "launch.bf16_gemm=fp32_accumulate"]}
BF16_GEMM["grad_scale_bf16_gemm"] = [*PLANTED["grad_scale_bf16"], "launch.bf16_gemm=fp32_accumulate"]


# --- the torchrun job: test_parallel's world-2 job (tests/torchrun_checks.py WORLD2) ----------------

CONFIGS = SEEDS | CORRECT | PLANTED | LATE | LOCAL | ADVERTISED | BF16_GEMM
EAGER = ["train.compile=false"]  # validation itself, eager (tests/test_parallel.py validates compiled blocks)
WORLD2.add("validate", "validation", {name: TINY + o + EAGER for name, o in CONFIGS.items()})


@beside
def validated(folder: Path) -> dict:
    """Rank 0's results per config: its figures reduced over the job, its failed checks' lines and its
    parameters' rows (what the database records)."""
    return {name: each[0] for name, each in per_config(WORLD2.part(folder, "validate", "validation")).items()}


# --- the assertions ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*SEEDS, *PLANTED, *BF16_GEMM])
def test_a_planted_scale_writes_the_gradients_where_the_step_reads_them(validated, name):
    """write_gradients of a TP model (both engines' configs here), through which the planted scales
    act: every gradient doubled, read back doubled (then restored), on every rank."""
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


@pytest.mark.parametrize("name", [*SEEDS, *CORRECT, "bf16_gemm"])
def test_each_tp_models_adamw_steps_the_dense_update_to_the_bit_at_every_step(validated, name):
    """The optimizer on identical inputs (tpbench.experiments.optimizer_check, at every step): a TP
    model's AdamW per tensor, given the dense weights, state and gradient (its shards), steps the
    dense update bit for bit, in fp32, bf16 and mixed, both engines; with no DP there is no
    reduction to check and no ZeRO-1 gather."""
    m = validated[name]["metrics"]
    assert m["optimizer_update_of_bound"] == 0.0
    assert "dp_reduce_of_bound" not in m and "optimizer_gather_of_bound" not in m


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
    assert re.match(rf"grad_rel_l2 {SCALED} at step [1-6] {value:.3g} > bound ", failure), failure
    assert f"(4 x {reference:.3g} + 1e-05)" in failure


@pytest.mark.parametrize("name", CORRECT)
def test_bf16_and_mixed_pass_every_steps_gradients_the_free_running_check_without_a_verdict(validated, name):
    """A correct model in bf16 and mixed precision, its gradients checked at every step at the dense
    weights: within K of the reference. The free-running checks are reported, their bound beside
    them, but decide nothing there (criterion: the first mixed run without the sign rule put a k_norm
    weight at 37x its reference)."""
    r = validated[name]
    assert r["failed"] == [] and r["metrics"]["passed"] == 1.0
    for check in ("fwd_logits_max_abs", "loss_abs_diff", "grad_rel_l2", "grad_row_rel_l2"):
        assert r["metrics"][f"{check}_of_bound"] <= 1, check
    assert [step for step, _ in r["curves"]["step_grad_of_bound"]] == [1, 2, 3, 4, 5, 6]
    assert r["metrics"]["adamw_param_rel_l2_of_bound"] > 0


# debug.from_step=5: the check and the parameter each late bug fails
LATE_FAILS = {
    "skip_sp_norms_from_5": ("grad_rel_l2", ("model.layers.0.input_layernorm.weight",)),
    "grad_scale_from_5": ("grad_rel_l2", (SCALED,)),
    "row_scale_from_5": ("grad_row_rel_l2", ("model.embed_tokens.weight", "lm_head.weight")),
    "head_scale_from_5": ("grad_row_rel_l2", (SCALED,)),
}


@pytest.mark.parametrize("name", LATE)
def test_a_bug_that_starts_at_step_5_fails_from_step_5_naming_its_check_and_parameter(validated, name):
    """Steps 1-4 within every bound, step 5 past one: the gradients are checked at every step, at
    the dense model's weights, so nothing of steps 1-4 hides or drowns step 5's error; the failure
    names the check, the parameter and its worst step (5 or 6: the bug acts at both)."""
    r = validated[name]
    curve = dict(map(tuple, r["curves"]["step_grad_of_bound"]))
    assert [s for s, of_bound in curve.items() if of_bound > 1] == [5, 6]
    check, params = LATE_FAILS[name]
    failures = [f for f in r["failed"] if f.startswith(f"{check} ")]
    assert any(re.match(rf"{check} ({'|'.join(params)}) at step [56] ", f) for f in failures), r["failed"]


def test_one_vocabulary_row_of_1024_off_by_a_hundredth_of_a_percent_fails_the_row_check(validated):
    """Row ROW of the embedding (tied to the LM head) x 1.0001 in fp32: its relative L2 over the
    whole parameter is diluted ~sqrt(1024)-fold, under the bound, and passes; the row check names
    the parameter with the row's own error, 1e-4."""
    r = validated["row_fp32"]
    name = "model.embed_tokens.weight"
    assert [f.split()[:2] for f in r["failed"]] == [["grad_row_rel_l2", name]]
    row, row_ref = r["rows"][name]
    assert row == pytest.approx(1e-4, rel=0.05) and row > 4 * row_ref + 1e-5
    whole, whole_ref = r["params"][name]
    assert whole < 4 * whole_ref + 1e-5 and whole < 1e-5


def test_one_head_off_by_a_hundredth_of_a_percent_fails_the_row_check_naming_its_weight(validated):
    """Head HEAD of layer 0's q_proj x 1.0001 in fp32: the worst head's error is that 1e-4."""
    r = validated["head_fp32"]
    assert any(f.startswith(f"grad_row_rel_l2 {SCALED} at step ") for f in r["failed"])
    assert r["rows"][SCALED][0] == pytest.approx(1e-4, rel=0.05)
    assert (HEAD, ROW) == (1, 3)  # the docs' figures were taken with these


@pytest.mark.parametrize("name", ADVERTISED)
def test_the_advertised_sensitivity_fails_in_each_precision(validated, name):
    """Issue 55 item 1: one gradient (SCALED) off by 0.002% in fp32 and by 5% in bf16 and mixed
    fails, naming it. For SCALED: other parameters' bounds are wider in bf16 (docs/usage.md)."""
    r = validated[name]
    assert r["metrics"]["passed"] == 0.0
    assert any(f.startswith(f"grad_rel_l2 {SCALED} at step ") for f in r["failed"]), r["failed"]


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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["validate.k=-1"], "validate.k=-1.0: accepted are finite numbers >= 0"),
        (["debug.grad_scale=0"], "debug.grad_scale=0.0 with kind=validate: scales one gradient"),
        (["kind=memory", "debug.grad_scale=1.05"], "debug.grad_scale=1.05 with kind=memory: scales"),
        (["debug.validate_fault=no_backward_sum", "parallel.engine=dtensor"], "with parallel.engine=dtensor"),
        (["debug.validate_fault=wrong"], "debug.validate_fault"),
        (
            ["debug.row_grad_scale=0"],
            "debug.row_grad_scale=0.0 with kind=validate: scales one vocabulary row",
        ),
        (
            ["kind=memory", "debug.head_grad_scale=1.05"],
            "debug.head_grad_scale=1.05 with kind=memory: scales",
        ),
        (["debug.from_step=0"], "debug.from_step=0 with kind=validate and validate.steps=20: the step a"),
        (["debug.from_step=21"], "accepted are 1 to validate.steps (20) with kind=validate"),
        (["kind=memory", "debug.from_step=2"], "debug.from_step=2 with kind=memory"),
        (
            ["debug.from_step=5", "debug.validate_fault=rope_offset"],
            "debug.from_step=5 with debug.validate_fault=rope_offset: from_step delays debug.grad_scale",
        ),
        (
            ["debug.low_precision_reduce=true", "parallel.dp=2"],
            "debug.low_precision_reduce=true with kind=validate, train.precision=pure and parallel.dp=2",
        ),
        (
            ["debug.low_precision_reduce=true", "train.dtype=bfloat16", "train.precision=mixed"],
            "train.precision=mixed and parallel.dp=1: reduces the DP gradients in bf16",
        ),
    ],
)
def test_bad_validation_settings_are_refused_before_launch(overrides, message):
    with pytest.raises(compose.ConfigError, match=re.escape(message)):
        compose.expand(["kind=validate", "tp=2", *overrides])


@pytest.mark.parametrize(
    "overrides",
    [
        ["debug.from_step=20", "debug.skip_grad_sum=[sp_norms]", "parallel.sp=true"],
        ["debug.low_precision_reduce=true", "train.dtype=bfloat16", "train.precision=mixed", "parallel.dp=2"],
        ["debug.row_grad_scale=1.05", "debug.head_grad_scale=1.05"],
    ],
)
def test_the_planted_bugs_are_accepted_where_they_act(overrides):
    assert len(compose.expand(["kind=validate", "tp=2", *overrides])) == 1


def test_runs_beside_one_dense_model_are_consecutive_ones_of_one_dense_side_up_to_the_cap():
    """dense_side.count_beside: the configs a warm worker validates as one (tpbench.run.worker): consecutive,
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
