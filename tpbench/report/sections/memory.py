"""Memory: the measured peak per rank against DDP's, its split by category, and the analytic prediction."""

from __future__ import annotations

import pandas as pd

from tpbench.report import charts, published, units
from tpbench.report.blocks import Chart, Section, Table, kind_empty
from tpbench.report.data import ReportData, memory_breakdown, memory_peaks


def section(data: ReportData) -> Section:
    section = Section(
        "memory",
        "Memory",
        intro="Per-rank peak of training steps after warm-up (the busiest rank), by layer count. "
        "On each bar: the change against DDP in the same setting.",
    )
    peaks = memory_peaks(data)
    if peaks.empty:
        section.empty = kind_empty(data, "memory")
        return section
    seed = published.seed_memory(peaks)
    parts = memory_breakdown(data)
    for i, (setting, group) in enumerate(peaks.groupby("setting", sort=False)):
        ref = seed[seed["setting"] == setting]
        section.blocks.append(
            Chart(f"Peak per rank: {setting}", charts.memory_peaks(group, ref, setting), f"memory-peak-{i}")
        )
        section.blocks.append(_peak_table(group, ref, setting))
        group_parts = parts[parts["setting"] == setting] if not parts.empty else parts
        if not group_parts.empty:
            section.blocks.append(
                Chart(
                    f"Breakdown of the peak: {setting}",
                    charts.memory_breakdown(group_parts, setting),
                    f"memory-breakdown-{i}",
                )
            )
            section.blocks.append(_breakdown_table(group_parts, setting))
    section.blocks += _memory_predicted(peaks)
    return section


def _peak_table(group: pd.DataFrame, ref: pd.DataFrame, setting: str) -> Table:
    frame = pd.DataFrame(
        {
            "layers": group["layers"],
            "mode": group["mode"],
            "run": group["id"],
            "peak / rank": group["peak_bytes"],
            "lowest rank": group["peak_min_bytes"],
            "of DDP": group["of_ddp"],
            "change vs DDP": group["of_ddp"] - 1,
        }
    )
    formats = {
        "peak / rank": units.mib,
        "lowest rank": units.mib,
        "of DDP": units.percent,
        "change vs DDP": units.signed_percent,
    }
    for column in ("max_memory_allocated_bytes", "max_memory_reserved_bytes"):
        if column in group and group[column].notna().any():
            label = column.removesuffix("_bytes").replace("_", " ")
            frame[label] = group[column]
            formats[label] = units.mib
    note = ""
    if not ref.empty:
        ref_peak = ref.set_index(["layers", "mode"])["peak_bytes"]
        keys = list(zip(group["layers"], group["mode"], strict=True))
        frame[published.SEED] = [ref_peak.get(k) for k in keys]
        frame["ours / published"] = frame["peak / rank"] / frame[published.SEED]
        formats |= {published.SEED: units.mib, "ours / published": units.percent}
        note = (
            f"{published.SEED}: the tensor-parallel chapter of github.com/ANKer661/minimind, measured on "
            "GPUs there; same config."
        )
    return Table(f"Peak per rank: {setting}", frame, formats, note)


def _breakdown_table(parts: pd.DataFrame, setting: str) -> Table:
    wide = parts.pivot_table(
        index=["layers", "mode_rank", "mode"], columns="part", values="measured_bytes", sort=False
    )
    wide = wide.sort_index().reset_index().drop(columns="mode_rank")
    wide.columns.name = None
    if parts["predicted_bytes"].fillna(0).gt(0).any():
        predicted = parts.pivot_table(
            index=["layers", "mode_rank", "mode"], columns="part", values="predicted_bytes", sort=False
        )
        predicted = predicted.sort_index().add_prefix("predicted ").reset_index(drop=True)
        wide = pd.concat([wide, predicted], axis=1)
    formats = {col: units.mib for col in wide.columns if col not in ("layers", "mode")}
    return Table(f"Breakdown of the peak (busiest rank): {setting}", wide, formats)


def _memory_predicted(peaks: pd.DataFrame) -> list[Table | Chart]:
    if "predicted_peak_bytes" not in peaks:
        return []
    rows = peaks[peaks["predicted_peak_bytes"].fillna(0) > 0]
    if rows.empty:
        return []
    blocks: list[Table | Chart] = []
    for i, (setting, group) in enumerate(rows.groupby("setting", sort=False)):
        blocks.append(
            Chart(
                f"Measured vs predicted peak: {setting}",
                charts.measured_vs_predicted(
                    group, "peak_bytes", "predicted_peak_bytes", "peak per rank (MiB)", setting
                ),
                f"memory-predicted-{i}",
                note="On each predicted bar: its error against the measurement.",
            )
        )
    frame = pd.DataFrame(
        {
            "setting": rows["setting"],
            "layers": rows["layers"],
            "mode": rows["mode"],
            "measured": rows["peak_bytes"],
            "predicted": rows["predicted_peak_bytes"],
            "error": rows["predicted_error"],
        }
    )
    formats = {"measured": units.mib, "predicted": units.mib, "error": units.signed_percent}
    blocks.append(Table("Measured vs predicted peak", frame, formats))
    return blocks
