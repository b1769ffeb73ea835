"""Validation's one criterion: what tells the rounding of a correct sharded model from a bug.

Every check compares a figure of the sharded model against the dense model (both in the run's
precision) with the same figure of the dense model against a reference, the dense model one
precision up, stepped beside them with the same AdamW on the same batches (fp64 for an fp32 run;
pure fp32 for bf16 and mixed). That second figure is the run's own rounding drift. A check passes
when

    sharded vs dense  <=  K x (dense vs reference)  +  floor

per parameter where the check is per parameter (the gradients, the parameters after the AdamW
steps), else on the one figure (the forward logits, the loss, the logits drift over the AdamW
steps). Two models that sum the same terms in different orders each carry an error of about e
against the exact result, so they differ by up to about 2e; the sharded model rounds a little more
often than the dense one (each rank's partial sums are rounded before the all-reduce adds them), and
one parameter's error is one draw, not an average. K is set from the validation grid
(benchmarks/validation_grid.py, docs/results/validation.md): over it, the largest ratio of
sharded-vs-dense to dense-vs-reference among the figures above their floor was 2.63 (bf16 at T 2,
seed 19, a q/k norm's gradient, over the tiny model's 200 bf16 runs; the forward logits 1.81), so
K = 4 leaves 1.5x room above it. It is 4, not 10
(the old K, which let a 20% gradient bug pass in bf16), so that one gradient off by 10% fails in
bf16, where each gradient's own error is 0.4-2.6e-2 (a 5% error fails for about half the parameters
there).

Where rounding decides the sign of an element's gradient, the parallel model steps that element with
the dense model's gradient (tpbench.experiments.signs, at every AdamW step): AdamW moves such an element
by about lr one way or the other and its momentum carries it on, a difference no reference, itself
one draw of that chance, can bound (issue 34: mixed precision failed a correct model on layer 0's
q/k norm weights, 8 elements each, one flipped; the Llama shape at T 4 on one embedding element).

The floors (ValidateConfig.tol_*) are the differences too small to mean anything whatever the
reference says: a figure under its floor passes even when the reference is 0 (an fp32 figure whose
fp64 reference happens to agree to the last bit). They sit far under any bug: a missing gradient sum
gives a relative gradient error of 0.5-1.8, a wrong RoPE offset logits off by 1e-2 and more.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from tpbench.config import ConfigError, RunConfig, mode_label, parallel_label
from tpbench.models.shapes import model_name, shape_label
from tpbench.results import ParamRow

K = 4.0  # ValidateConfig.k's default

# (figure, what it is, the ValidateConfig floor, the reference figure, the ParamRow fields of a
# per-parameter check). The loss is one scalar: the dense model's own error on it cancels by chance
# (2.9e-6 against a sharded-vs-dense 4.0e-5 at tp 2, mixed), so its reference is the mean over
# tokens of the dense model's |per-token loss error|, which bounds the scalar's error and cannot cancel.
CHECKS = (
    ("fwd_logits_max_abs", "forward max |logits diff|", "tol_fwd", "dense_fwd_logits_max_abs", None),
    ("loss_abs_diff", "|loss diff|", "tol_loss", "dense_token_loss_mean_abs_diff", None),
    ("grad_rel_l2", "gradient relative L2", "tol_grad_rel", None, ("grad_rel_l2", "grad_ref_rel_l2")),
    ("adamw_param_rel_l2", "AdamW x{steps}: param diff / update", "tol_param", None,
     ("param_rel_l2", "param_ref_rel_l2")),
    ("adamw_drift_max_abs", "AdamW x{steps}: worst step's max |logits diff|", "tol_drift",
     "dense_adamw_drift_max_abs", None),
)  # fmt: skip


@dataclass
class Verdict:
    """One check's worst item (a parameter, or the whole model) against its bound."""

    check: str
    what: str
    param: str  # the worst parameter; "" for a check of the whole model
    value: float  # sharded vs dense
    reference: float  # dense vs the reference model
    floor: float
    k: float = K

    @property
    def bound(self) -> float:
        return self.k * self.reference + self.floor

    @property
    def ok(self) -> bool:
        return self.value <= self.bound

    @property
    def of_bound(self) -> float:
        """value / bound: at most 1 passes."""
        return self.value / self.bound if self.bound > 0 else float("inf") if self.value > 0 else 0.0

    def failure(self) -> str:
        """The check, the parameter, its figure against its bound: how a run says it failed."""
        where = f" {self.param}" if self.param else ""
        return (
            f"{self.check}{where} {self.value:.3g} > bound {self.bound:.3g} "
            f"({self.k:g} x {self.reference:.3g} + {self.floor:.3g})"
        )


def verdicts(cfg: RunConfig, figures: dict[str, float], rows: list[ParamRow]) -> list[Verdict]:
    """Every check's verdict: per parameter checks give their worst parameter (largest value / bound)."""
    out = []
    for check, what, floor, reference, fields in CHECKS:
        floor_value, k = getattr(cfg.validate, floor), cfg.validate.k
        if fields is None:
            out.append(Verdict(check, what, "", figures[check], figures[reference], floor_value, k))
            continue
        value, ref = fields
        per_param = [
            Verdict(check, what, r.name, getattr(r, value), getattr(r, ref), floor_value, k)
            for r in rows
            if getattr(r, value) is not None
        ]
        out.append(max(per_param, key=lambda v: v.of_bound))
    return out


def table(cfg: RunConfig, checks: list[Verdict], rows: list[ParamRow], passed: bool) -> str:
    """The verdicts, the parameters nearest their bound, and the gradient error by semantics."""
    p, t = cfg.parallel, cfg.train
    reference = "fp64" if t.dtype == "float32" else "fp32"
    title = f"validate {mode_label(p)}  {parallel_label(p)}  {t.dtype} {t.precision}"
    title += f"  {model_name(cfg.model)} {shape_label(cfg.model)} seq {t.seq_len}"
    if cfg.launch.bf16_gemm != "native":  # tpbench.models.gemm
        title += "  bf16 GEMMs: fp32-accumulated, rounded once"
    main = Table(title=title)
    for col in ("check", "worst parameter", "measured", f"dense vs {reference}", "bound", "ok"):
        main.add_column(col, justify="left" if col in ("check", "worst parameter") else "right", no_wrap=True)
    for v in checks:
        cells = (f"{v.value:.2e}", f"{v.reference:.2e}", f"{v.bound:.1e}", "yes" if v.ok else "NO")
        main.add_row(v.what.format(steps=cfg.validate.steps), v.param or "-", *cells)
    nearest = Table(title="parameters nearest their bound")
    for col in ("check", "parameter", "measured", f"dense vs {reference}", "bound", "of bound"):
        nearest.add_column(col, justify="left" if col in ("check", "parameter") else "right", no_wrap=True)
    floors = {check: getattr(cfg.validate, floor) for check, _, floor, _, _ in CHECKS}
    ranked = []
    for check, _, _, _, fields in CHECKS:
        if fields is None:
            continue
        for r in rows:
            if getattr(r, fields[0]) is not None:
                value, ref = getattr(r, fields[0]), getattr(r, fields[1])
                ranked.append(Verdict(check, "", r.name, value, ref, floors[check], cfg.validate.k))
    for v in sorted(ranked, key=lambda v: -v.of_bound)[:5]:
        nearest.add_row(
            v.check, v.param, f"{v.value:.2e}", f"{v.reference:.2e}", f"{v.bound:.1e}", f"{v.of_bound:.2f}"
        )
    by_sem = Table(title="gradient error by semantics")
    for col in ("semantics", "params", "max |diff|", "max rel L2"):
        by_sem.add_column(col, justify="right" if col != "semantics" else "left")
    for sem in sorted({r.semantics for r in rows}):
        group = [r for r in rows if r.semantics == sem]
        by_sem.add_row(
            sem,
            str(len(group)),
            f"{max(r.grad_max_abs for r in group):.2e}",
            f"{max(r.grad_rel_l2 for r in group):.2e}",
        )
    out = io.StringIO()
    console = Console(file=out, width=140, force_terminal=False)
    console.print(main)
    console.print(nearest)
    console.print(by_sem)
    console.print(
        f"bound: {cfg.validate.k:g} x (dense vs the dense model in {reference}) + floor, per parameter "
        f"for the gradients and the AdamW parameters; verdict: {'PASSED' if passed else 'FAILED'}"
    )
    return out.getvalue()


def check_validate_faults(cfg: RunConfig) -> None:
    """The validation's planted faults (debug.validate_fault, debug.grad_scale) where they can act;
    raises ConfigError naming the bad value and what is accepted (tpbench.run.compose calls it)."""
    if cfg.debug.validate_fault and (cfg.kind != "validate" or cfg.parallel.tp * cfg.parallel.dp < 2):
        raise ConfigError(
            f"debug.validate_fault={cfg.debug.validate_fault} with kind={cfg.kind} and "
            f"{cfg.parallel.tp * cfg.parallel.dp} rank(s): plants an error on rank 1 of a validation, "
            "accepted with kind=validate and tp x dp >= 2"
        )
    if cfg.debug.validate_fault == "no_backward_sum" and (
        cfg.parallel.engine != "megatron" or cfg.parallel.tp < 2
    ):
        raise ConfigError(
            f"debug.validate_fault=no_backward_sum with parallel.engine={cfg.parallel.engine} and tp="
            f"{cfg.parallel.tp}: drops a region entry's backward collective, accepted with "
            "parallel.engine=megatron and tp >= 2"
        )
    if cfg.debug.grad_scale != 1.0 and (
        cfg.kind != "validate" or not 0 < cfg.debug.grad_scale < float("inf")
    ):
        raise ConfigError(
            f"debug.grad_scale={cfg.debug.grad_scale} with kind={cfg.kind}: scales one gradient of a "
            "validation, accepted are finite numbers > 0 with kind=validate"
        )


def check_bf16_gemm(cfg: RunConfig) -> None:
    """launch.bf16_gemm=fp32_accumulate (tpbench.models.gemm): bf16 validation's GEMMs as a GPU
    computes them, refused where it would change nothing or slow a measurement (on CUDA:
    tpbench.run.compose.resolve_device); raises ConfigError naming the value and what is accepted."""
    if cfg.launch.bf16_gemm == "native":
        return
    what = f"launch.bf16_gemm={cfg.launch.bf16_gemm}"
    if cfg.train.dtype != "bfloat16":
        raise ConfigError(
            f"{what} with train.dtype={cfg.train.dtype}: it computes bf16 GEMMs; accepted is "
            "train.dtype=bfloat16 (precision pure or mixed)"
        )
    if cfg.kind != "validate" or cfg.train.compile is True:
        why = f"kind={cfg.kind}" if cfg.kind != "validate" else "train.compile=true"
        raise ConfigError(
            f"{what} with {why}: it emulates a GPU's bf16 arithmetic for validation and would slow a "
            "measured step; accepted is kind=validate with train.compile=false"
        )
