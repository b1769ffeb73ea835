"""Communication: the collectives each rank issued per step, measured beside the prediction."""

from __future__ import annotations

import pandas as pd

from tpbench.report import charts, units
from tpbench.report.blocks import Chart, Section, Table, pick
from tpbench.report.data import ReportData, comm_predicted
from tpbench.report.data import collectives as collectives_frame
from tpbench.report.labels import levels_in


def section(data: ReportData) -> Section:
    section = Section(
        "communication",
        "Communication",
        intro="Collectives of one training step, by type and purpose: calls, and bytes on the wire per rank "
        "(ring: all-reduce 2(T-1)/T N, all-gather and reduce-scatter (T-1)/T N), busiest rank. "
        "Counted in the run's own kind (throughput, else memory, else validate).",
    )
    frame = collectives_frame(data)
    if frame.empty:
        section.empty = "No collectives recorded in this selection."
        return section
    for i, (setting, group) in enumerate(frame.groupby("setting", sort=False)):
        titled = setting + levels_in(group)
        section.blocks.append(
            Chart(f"Collectives per step: {titled}", charts.collectives(group, setting), f"comm-{i}")
        )
        table = pd.DataFrame(
            {
                "layers": group["layers"],
                "mode": group["label"],
                "layout": group["layout"],
                "switches": group["switches"] if "switches" in group else "",
                "run": group["run_id"],
                "kind": group["kind"],
                "op": group["op"],
                "purpose": group["purpose"],
                "calls / step": group["count"],
                "bytes / step": group["bytes"],
                "time / step": group["time_s"],
                "exposed / step": group["exposed_s"],
            }
        )
        formats = {
            "calls / step": units.count,
            "bytes / step": units.size,
            "time / step": units.ms,
            "exposed / step": units.ms,
        }
        section.blocks.append(Table(f"Collectives per step: {titled}", table, formats))
    predicted = comm_predicted(data)
    if not predicted.empty:
        columns = {
            "setting": ("setting", None),
            "layers": ("layers", None),
            "mode": ("label", None),
            "layout": ("layout", None),
            "kind": ("kind", None),
            "measured": ("comm_bytes_per_step", units.size),
            "predicted": ("predicted_comm_bytes_per_step", units.size),
            "error": ("error", units.signed_percent),
        }
        section.blocks.append(pick("Bytes per step per rank, measured vs predicted", predicted, columns))
    return section
