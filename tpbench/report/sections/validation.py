"""Validation: each parallel run against the dense model, forward, backward and over steps."""

from __future__ import annotations

import pandas as pd

from tpbench.report import charts, published, units
from tpbench.report.blocks import Chart, Section, Table, kind_empty, pick
from tpbench.report.data import STEP_GRAD, ReportData, drift, drift_table, validation
from tpbench.report.labels import levels_in

SEED_NOTE = (
    f"{published.SEED}: the numerical check of the tensor-parallel chapter of github.com/ANKer661/minimind "
    "(its section 2.15.3), which holds on T 2, H 128, L 6, heads 8/4, V 6400, S 256, fp32, 200 AdamW "
    "steps on one fixed batch, the logits compared every 20 steps (`+preset=seed_check`). It states its "
    "AdamW logits figure as a bound over the run (<= 1.3e-3) and the gradients' relative L2 as about "
    "1e-6; not its learning rate nor its batch (ours: validate.lr and train.micro_batch)."
)


def section(data: ReportData) -> Section:
    section = Section(
        "validation",
        "Validation",
        intro="Each parallel model against the dense model built from the same weights and fed the same "
        "tokens: forward logits and loss, every gradient, then AdamW steps, each on a fresh batch "
        "(validate.batch=fresh, the logits compared on one batch kept aside) or all on one fixed batch "
        "(fixed, the seed chapter's check, the logits compared on it), and the final parameters.",
    )
    runs = validation(data)
    if runs.empty:
        section.empty = kind_empty(data, "validate")
        return section
    curves = drift(data)
    worst = curves.groupby("run_id")["value"].max()
    runs = runs.assign(drift_max=runs["id"].map(worst))
    columns = {
        "run": ("id", None),
        "mode": ("label", None),
        "layout": ("layout", None),
        "layers": ("layers", None),
        "setting": ("setting", None),
        "forward max |logits diff|": ("fwd_logits_max_abs", units.sci),
        "|loss diff|": ("loss_abs_diff", units.sci),
        "gradient max |diff|": ("grad_max_abs", units.sci),
        "gradient max rel L2": ("grad_max_rel_l2", units.sci),
        "AdamW steps": ("adamw_steps", None),
        "AdamW batch": ("validate_batch", None),
        "AdamW max |logits diff|": ("drift_max", units.sci),
        "AdamW final max |param diff|": ("adamw_param_max_abs", units.sci),
        "AdamW final max param diff / update": ("adamw_param_max_rel_l2", units.sci),
        "worst check / bound": ("worst_of_bound", lambda v: units.text(v) if v != v else f"{v:.2f}"),
        "verdict": ("passed", units.passed),
    }
    of_bound = [c for c in runs.columns if str(c).endswith("_of_bound")]  # runs before them: none
    runs = runs.assign(worst_of_bound=runs[of_bound].max(axis=1) if of_bound else float("nan"))
    table = pick("Checks against dense", runs, columns)
    table.verdict = "verdict"
    if any(published.seed_check_matches(run) for _, run in runs.iterrows()):
        seed = published.SEED_CHECK
        row = {"run": published.SEED, "mode": "tp", "layout": "tp=2 dp=1", "layers": 6, "AdamW steps": 200}
        row |= {label: seed.get(key) for label, (key, _) in columns.items() if key in seed}
        row |= {"AdamW batch": "fixed", "AdamW max |logits diff|": seed["adamw_logits_max_abs"]}
        table.frame = pd.concat([table.frame, pd.DataFrame([row])], ignore_index=True)[table.frame.columns]
        table.note = f"Last row: {SEED_NOTE}"
    section.blocks.append(table)
    if (nearest := _nearest_bound(data, runs)) is not None:
        section.blocks.append(nearest)
    steps = drift_table(data)  # empty when no run recorded a drift curve (a run of 0 AdamW steps)
    for (setting, batch), group in (
        () if steps.empty else steps.groupby(["setting", "validate_batch"], sort=False)
    ):
        section.blocks.append(_drift_table(group, setting, batch, runs))
    grads = drift_table(data, STEP_GRAD)  # empty for runs before the per-step gradient check
    for setting, group in () if grads.empty else grads.groupby("setting", sort=False):
        section.blocks.append(_step_grad_table(group, setting))
    if not curves.empty:
        section.blocks.append(
            Chart(
                "AdamW drift",
                charts.drift(curves, "AdamW: max |logits diff| against dense on a fixed batch"),
                "validation-drift",
            )
        )
    return section


# per-parameter check -> (its figure, its reference, its floor's config key), as in
# tpbench.experiments.criterion.CHECKS
PER_PARAM = {
    "gradient rel L2": ("grad_rel_l2", "grad_ref_rel_l2", "validate.tol_grad_rel", 1e-5),
    "AdamW param diff / update": ("param_rel_l2", "param_ref_rel_l2", "validate.tol_param", 1e-3),
}


def _nearest_bound(data: ReportData, runs: pd.DataFrame, n: int = 8) -> Table | None:
    """The `n` parameters nearest their bound (k x the dense model's own figure + the floor) over the
    runs shown, both per-parameter checks together; None when no run recorded them (older runs)."""
    params = data.params
    if params.empty or "grad_ref_rel_l2" not in params or params["grad_ref_rel_l2"].isna().all():
        return None
    params = params[params["run_id"].isin(runs["id"])]
    rows = []
    for check, (value, ref, floor_key, floor_default) in PER_PARAM.items():
        got = params.dropna(subset=[value, ref])
        config = got["run_id"].map(lambda i: data.configs.get(i, {}))
        k = config.map(lambda c: c.get("validate.k", 4.0))
        bound = k * got[ref] + config.map(lambda c, key=floor_key, default=floor_default: c.get(key, default))
        rows.append(got.assign(check=check, value=got[value], reference=got[ref], bound=bound))
    frame = pd.concat(rows, ignore_index=True)
    frame = frame.assign(of_bound=frame["value"] / frame["bound"]).nlargest(n, "of_bound")
    mode = frame["run_id"].map(runs.set_index("id")["label"])
    frame = pd.DataFrame(
        {
            "run": frame["run_id"],
            "mode": mode,
            "check": frame["check"],
            "parameter": frame["name"],
            "measured": frame["value"],
            "dense vs reference": frame["reference"],
            "bound": frame["bound"],
            "of bound": frame["of_bound"],
        }
    )
    formats = {c: units.sci for c in ("measured", "dense vs reference", "bound")}
    note = (
        "Sharded against dense, per parameter, beside the dense model against the reference (itself one "
        "precision up: fp64 for an fp32 run, fp32 for bf16 and mixed); bound = validate.k x that + the "
        "check's floor; of bound above 1 fails."
    )
    return Table("Parameters nearest their bound", frame, formats | {"of bound": lambda v: f"{v:.2f}"}, note)


def _drift_table(steps: pd.DataFrame, setting: str, batch: str, runs: pd.DataFrame) -> Table:
    """One row per compared step, per run (mode) its logits' mean and max |diff| and relative L2
    against dense; a last row with each column's worst over the run."""
    steps = steps.astype({"step": int})
    step = pd.Series(sorted(steps["step"].unique()))
    columns = {"step": step}
    for (run_id, mode), run in steps.groupby(["run_id", "label"], sort=False):
        label = mode if steps.drop_duplicates("run_id")["label"].is_unique else f"{mode} #{run_id}"
        by_step = run.set_index("step")
        for figure, what in (("mean", "mean"), ("max", "max"), ("rel_l2", "rel L2")):
            columns[f"{label} {what}"] = step.map(by_step[figure])
    frame = pd.DataFrame(columns)  # at once: a column added at a time fragments a frame of many runs
    formats = {col: units.sci for col in columns if col != "step"}
    worst = {"step": "worst"} | {col: frame[col].max() for col in formats}
    frame = pd.concat([frame.astype({"step": object}), pd.DataFrame([worst])], ignore_index=True)
    note = "Each figure is the worst over the ranks; relative L2: ||sharded - dense|| / ||dense||."
    shown = runs[runs["id"].isin(steps["run_id"])]
    if any(published.seed_check_matches(run) for _, run in shown.iterrows()):
        seed = published.SEED_CHECK["adamw_logits_max_abs"]
        note += (
            f" {published.SEED}: max |logits diff| <= {seed:.1e} over the run, on T 2, H 128, L 6, heads "
            "8/4, V 6400, S 256, fp32, 200 AdamW steps on one fixed batch (see the checks' last row)."
        )
    title = f"AdamW drift against dense ({batch} batch): {setting}{levels_in(steps)}"
    return Table(title, frame, formats, note)


def _step_grad_table(steps: pd.DataFrame, setting: str) -> Table:
    """One row per step, per run (mode) the worst parameter's gradient relative L2 against dense at
    the same weights and its figure / bound; a last row with each column's worst over the run."""
    steps = steps.astype({"step": int})
    step = pd.Series(sorted(steps["step"].unique()))
    columns = {"step": step}
    unique = steps.drop_duplicates("run_id")["label"].is_unique
    for (run_id, mode), run in steps.groupby(["run_id", "label"], sort=False):
        label = mode if unique else f"{mode} #{run_id}"
        by_step = run.set_index("step")
        columns[f"{label} rel L2"] = step.map(by_step["rel_l2"])
        columns[f"{label} of bound"] = step.map(by_step["of_bound"])
    frame = pd.DataFrame(columns)
    formats = {col: units.sci if col.endswith("rel L2") else _ratio for col in columns if col != "step"}
    worst = {"step": "worst"} | {col: frame[col].max() for col in formats}
    frame = pd.concat([frame.astype({"step": object}), pd.DataFrame([worst])], ignore_index=True)
    note = (
        "At every AdamW step both models' gradients at the same weights (the dense model's current ones, "
        "loaded into the sharded model): the worst parameter's ||sharded - dense|| / ||dense|| and the "
        "worst figure / bound (above 1 fails), each the worst over the ranks."
    )
    return Table(f"Gradients against dense at every step: {setting}{levels_in(steps)}", frame, formats, note)


def _ratio(v: float) -> str:
    return units.text(v) if v != v else f"{v:.2f}"
