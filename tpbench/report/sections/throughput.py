"""Throughput: tokens per second and step times, per mode and setting."""

from __future__ import annotations

import pandas as pd

from tpbench.report import charts, published, units
from tpbench.report.blocks import Chart, Section, Table, kind_empty, pick, timed_by, yes_no
from tpbench.report.data import LOADED_RULE, ReportData, throughput
from tpbench.report.labels import levels_in


def section(data: ReportData) -> Section:
    section = Section(
        "throughput",
        "Throughput",
        intro="Training steps after warm-up: median step time with its p10-p90 spread, and tokens/s. "
        "Compare modes within one setting: under fixed_global every mode trains the same global batch, "
        "the same tokens per step (`+preset=seed_throughput`); vs DDP is tokens/s against DDP's. "
        "Switches: parallel.overlap (backward collectives behind compute), train.fused_optimizer. "
        "Communication: the time of one step's collectives, the part the ranks waited on (exposed, "
        "the busiest rank) and the fraction hidden behind compute (the least-hidden rank). The first "
        "step (compiling included under train.compile) is apart from the median. Timed by CUDA events "
        "on NCCL, by the host's wall clock elsewhere. Predicted step: the time model's, recorded with "
        "each run (docs/time-model.md), and its error against the measured median; step CPU time: a "
        "rank's CPU time per step, what the step costs without the waiting for cores of a loaded machine. "
        "On CUDA the timed steps run back to back; step issue is the host's time to enqueue a step "
        "(the slowest rank's median) and a run is host-bound where that is >= 90% of its step: the GPU "
        "then waits for Python, and the step measures dispatch, not the mode. "
        "Load before the job: the machine's load average on its cores as the run's job started. "
        f"{LOADED_RULE}.",
    )
    runs = throughput(data)
    if runs.empty:
        section.empty = kind_empty(data, "throughput")
        return section
    if "predicted_step_time_s" in runs:  # the time model's (tpbench.predict.steptime), recorded beside
        runs = runs.assign(step_time_error=runs["predicted_step_time_s"] / runs["step_time_s"] - 1)
    for i, (setting, group) in enumerate(runs.groupby("setting", sort=False)):
        titled = setting + levels_in(group)
        section.blocks.append(
            Chart(f"Throughput: {titled}", charts.throughput(group, setting), f"throughput-{i}")
        )
        columns = {
            "layers": ("layers", None),
            "mode": ("label", None),
            "layout": ("layout", None),
            "switches": ("switches", None),
            "run": ("id", None),
            "tokens/s": ("tokens_per_s", units.tokens_per_s),
            "tokens/s per device": ("tokens_per_s_per_device", units.tokens_per_s),
            "vs DDP": ("of_ddp", units.percent),
            "tokens / step": ("tokens_per_step", units.count),
            "step time": ("step_time_s", units.ms),
            "p10": ("step_time_p10_s", units.ms),
            "p90": ("step_time_p90_s", units.ms),
            "predicted step": ("predicted_step_time_s", units.ms),
            "error": ("step_time_error", units.signed_percent),
            "step CPU time": ("step_cpu_time_s", units.ms),
            "step issue (host)": ("step_issue_s", units.ms),
            "host-bound": ("host_bound", yes_no),
            "first step": ("first_step_s", units.ms),
            "comm time": ("comm_time_s", units.ms),
            "comm exposed": ("comm_exposed_s", units.ms),
            "comm hidden": ("comm_hidden_fraction", units.percent),
            "executed FLOPs / step": ("flops_per_step", units.flops),
            "MFU": ("mfu", units.percent),
            "timed by": ("timing_cuda_events", timed_by),
            "load before the job": ("machine_load", None),
        }
        table = pick(f"Throughput: {titled}", group, columns)
        if published.tron_throughput_matches(group.iloc[0]):
            _beside_tron(table, group)
        if group["loaded"].any():
            runs_loaded = ", ".join(map(str, group.loc[group["loaded"], "id"]))
            table.note = " ".join(filter(None, [f"{LOADED_RULE}: here run(s) {runs_loaded}.", table.note]))
        section.blocks.append(table)
    return section


def _beside_tron(table: Table, group: pd.DataFrame) -> None:
    """minimind-tron's DDP and TP tokens/s as rows of their own, at the layers of the runs."""
    tron = published.TRON_TOKENS_PER_S
    rows = [
        {"layers": 8, "mode": mode, "run": published.TRON, "tokens/s": value, "vs DDP": value / tron["ddp"]}
        for mode, value in tron.items()
    ]
    table.frame = pd.concat([table.frame, pd.DataFrame(rows)], ignore_index=True)[table.frame.columns]
    table.note = (
        f"Last rows: {published.TRON}, the unified benchmark of github.com/ANKer661/minimind "
        "(book/src/unified_benchmark.qmd) on two RTX 4090D GPUs over PCIe: H 768, L 8, heads 8/4, "
        "V 6400, S 2048, bf16, fixed_global; its global batch is not stated (`+preset=tron_throughput` "
        "uses 8). Other hardware than ours: compare the ratios to DDP."
    )
