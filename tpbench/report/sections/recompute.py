"""Activation recompute: what each train.recompute setting saves in memory, and costs in time."""

from __future__ import annotations

from tpbench.report import charts, units
from tpbench.report.blocks import Chart, Section, integer, pick
from tpbench.report.data import ReportData, recompute
from tpbench.report.labels import levels_in


def section(data: ReportData) -> Section:
    section = Section(
        "recompute",
        "Activation recompute",
        intro="train.recompute = none, selective (the SwiGLU's product made again in backward), op "
        "(torchtitan's per-op policy: every second matmul and the elementwise ops made again), full "
        "(each block run again from its input): per-rank peak (memory runs) and "
        "median step time (throughput runs) of each setting, against the same mode without recompute.",
    )
    frame = recompute(data)
    if frame.empty:
        section.empty = "No config was measured with more than one train.recompute setting."
        return section
    for i, (setting, group) in enumerate(frame.groupby("base_setting", sort=False)):
        titled = setting + levels_in(group)
        section.blocks.append(
            Chart(f"Recompute: {titled}", charts.recompute(group, setting), f"recompute-{i}")
        )
        columns = {
            "layers": ("layers", None),
            "mode": ("label", None),
            "recompute": ("recompute", None),
            "memory run": ("memory_run", integer),
            "peak / rank": ("peak_bytes", units.mib),
            "predicted": ("predicted_peak_bytes", units.mib),
            "peak of none": ("peak_of_none", units.percent),
            "throughput run": ("throughput_run", integer),
            "step time": ("step_time_s", units.ms),
            "p10": ("step_time_p10_s", units.ms),
            "p90": ("step_time_p90_s", units.ms),
            "step of none": ("step_of_none", units.ratio),
            "executed FLOPs / step": ("flops_per_step", units.flops),
            "predicted recompute FLOPs": ("predicted_recompute_flops_per_step", units.flops),
        }
        section.blocks.append(pick(f"Recompute: {titled}", group, columns))
    return section
