"""Validation: each parallel run against the dense model, forward, backward and over steps."""

from __future__ import annotations

import pandas as pd

from tpbench.report import charts, published, units
from tpbench.report.blocks import Chart, Section, kind_empty, pick
from tpbench.report.data import ReportData, drift, validation


def section(data: ReportData) -> Section:
    section = Section(
        "validation",
        "Validation",
        intro="Each parallel model against the dense model built from the same weights and fed the same "
        "tokens: forward logits and loss, every gradient, then AdamW steps (logits on a fixed batch, final "
        "parameters).",
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
        "mode": ("mode", None),
        "tp×dp": ("tp_dp", None),
        "layers": ("layers", None),
        "setting": ("setting", None),
        "forward max |logits diff|": ("fwd_logits_max_abs", units.sci),
        "|loss diff|": ("loss_abs_diff", units.sci),
        "gradient max |diff|": ("grad_max_abs", units.sci),
        "gradient max rel L2": ("grad_max_rel_l2", units.sci),
        "AdamW steps": ("adamw_steps", None),
        "AdamW max |logits diff|": ("drift_max", units.sci),
        "AdamW final max |param diff|": ("adamw_param_max_abs", units.sci),
        "verdict": ("passed", units.passed),
    }
    runs = runs.assign(tp_dp=runs["tp"].astype(str) + "×" + runs["dp"].astype(str))
    table = pick("Checks against dense", runs, columns)
    table.verdict = "verdict"
    if any(published.seed_check_matches(run) for _, run in runs.iterrows()):
        seed = published.SEED_CHECK
        row = {"run": published.SEED, "mode": "tp", "tp×dp": "2×1", "layers": 6, "AdamW steps": 200}
        row |= {label: seed.get(key) for label, (key, _) in columns.items() if key in seed}
        row["AdamW max |logits diff|"] = seed["adamw_logits_max_abs"]
        table.frame = pd.concat([table.frame, pd.DataFrame([row])], ignore_index=True)[table.frame.columns]
        table.note = (
            f"Last row: {published.SEED}, from the tensor-parallel chapter of "
            "github.com/ANKer661/minimind, on the same config."
        )
    section.blocks.append(table)
    if not curves.empty:
        section.blocks.append(
            Chart(
                "AdamW drift",
                charts.drift(curves, "AdamW: max |logits diff| against dense on a fixed batch"),
                "validation-drift",
            )
        )
    return section
