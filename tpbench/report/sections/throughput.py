"""Throughput: tokens per second and step times, per mode and setting."""

from __future__ import annotations

from tpbench.report import charts, units
from tpbench.report.blocks import Chart, Section, kind_empty, pick, timed_by
from tpbench.report.data import ReportData, throughput


def section(data: ReportData) -> Section:
    section = Section(
        "throughput",
        "Throughput",
        intro="Training steps after warm-up: median step time with its p10-p90 spread, and tokens/s. "
        "Compare modes within one setting: under fixed_global every mode trains the same global batch. "
        "Switches: parallel.overlap (backward collectives behind compute), train.fused_optimizer. "
        "Communication: the time of one step's collectives, the part the ranks waited on (exposed, "
        "the busiest rank) and the fraction hidden behind compute (the least-hidden rank). The first "
        "step (compiling included under train.compile) is apart from the median. Timed by CUDA events "
        "on NCCL, by the host's wall clock elsewhere.",
    )
    runs = throughput(data)
    if runs.empty:
        section.empty = kind_empty(data, "throughput")
        return section
    for i, (setting, group) in enumerate(runs.groupby("setting", sort=False)):
        section.blocks.append(
            Chart(f"Throughput: {setting}", charts.throughput(group, setting), f"throughput-{i}")
        )
        columns = {
            "layers": ("layers", None),
            "mode": ("mode", None),
            "switches": ("switches", None),
            "run": ("id", None),
            "tokens/s": ("tokens_per_s", units.tokens_per_s),
            "tokens/s per device": ("tokens_per_s_per_device", units.tokens_per_s),
            "step time": ("step_time_s", units.ms),
            "p10": ("step_time_p10_s", units.ms),
            "p90": ("step_time_p90_s", units.ms),
            "first step": ("first_step_s", units.ms),
            "comm time": ("comm_time_s", units.ms),
            "comm exposed": ("comm_exposed_s", units.ms),
            "comm hidden": ("comm_hidden_fraction", units.percent),
            "executed FLOPs / step": ("flops_per_step", units.flops),
            "MFU": ("mfu", units.percent),
            "timed by": ("timing_cuda_events", timed_by),
        }
        section.blocks.append(pick(f"Throughput: {setting}", group, columns))
    return section
