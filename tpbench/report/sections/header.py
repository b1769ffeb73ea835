"""The report's header: what was selected, how many runs, which failed and why."""

from __future__ import annotations

import pandas as pd

from tpbench.report import units
from tpbench.report.blocks import Chart, Section, Table, integer, mode_key
from tpbench.report.data import ReportData


def section(data: ReportData) -> Section:
    runs = data.runs
    ok, failed = len(data.ok), len(data.failed)
    span = f"{runs['started_at'].min():%Y-%m-%d %H:%M} to {runs['ended_at'].max():%Y-%m-%d %H:%M} UTC"
    kinds = sorted(set(runs["hardware"]))
    mixed = len(kinds) > 1
    facts = pd.DataFrame(
        {
            "": ["generated", "database", "selection", "runs", "run between", "hardware"],
            "value": [
                f"{data.generated_at:%Y-%m-%d %H:%M:%S} UTC",
                data.db_url,
                data.selection.describe(),
                f"{len(runs)}: {ok} OK, {failed} not OK",
                span,
                f"{len(kinds)} kinds, mixed: {'; '.join(kinds)}" if mixed else kinds[0],
            ],
        }
    )
    what = (
        runs.groupby(["kind", "sweep"], sort=False)
        .agg(
            modes=("label", lambda m: ", ".join(sorted(set(m), key=mode_key))),
            layers=("layers", lambda v: ", ".join(map(str, sorted(set(v))))),
            hardware=("hardware", lambda h: "; ".join(sorted(set(h)))),
            settings=("setting", lambda s: "; ".join(sorted(set(s)))),
            runs=("id", "count"),
            ok=("status", lambda s: int((s == "OK").sum())),
        )
        .reset_index()
    )
    env = runs.assign(
        commit=runs["git_commit"].map(lambda c: c[:10] if isinstance(c, str) else units.DASH)
        + runs["git_dirty"].map(lambda d: " (dirty)" if pd.notna(d) and d else "")
    )
    where = (
        env.groupby(["hardware", "backend", "torch_version", "cuda_version", "commit", "host"], dropna=False)
        .agg(runs=("id", "count"))
        .reset_index()
    )
    blocks: list[Table | Chart] = [
        Table("Report", facts),
        Table("What was run", what),
        Table("Where it ran", where),
    ]
    if failed:
        cols = [
            "id",
            "started_at",
            "kind",
            "label",
            "layout",
            "sweep",
            "status",
            "failed_rank",
            "error",
            "log_dir",
        ]
        blocks.append(
            Table(
                f"Runs that did not end OK ({failed})",
                data.failed[cols].rename(columns={"started_at": "started (UTC)", "label": "mode"}),
                {"started (UTC)": lambda t: f"{t:%Y-%m-%d %H:%M}", "failed_rank": integer},
            )
        )
    intro = (
        f"Mixed hardware: these runs ran on {len(kinds)} kinds of machine ({'; '.join(kinds)}). Each setting "
        f"below names its hardware, and figures are compared within one setting only."
        if mixed
        else ""
    )
    return Section("header", "tpbench report: DDP vs TP vs SP vs VP", intro, blocks)
