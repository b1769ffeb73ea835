"""Memory: the measured peak per rank against DDP's, its split by category, the analytic prediction,
and over depth: each mode's peak as F + L (a/T + r), fitted to the runs and predicted
(tpbench.predict.theory.depth), with its ratio to DDP's at each depth and as L grows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from tpbench.config import RunConfig, local_batch, mode_label
from tpbench.predict.theory import depth
from tpbench.report import charts, published, units
from tpbench.report.blocks import Chart, Section, Table, kind_empty
from tpbench.report.data import ReportData, memory_breakdown, memory_peaks
from tpbench.report.labels import levels_in
from tpbench.report.sections.diagrams import run_config


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
        titled = setting + levels_in(group)
        section.blocks.append(
            Chart(f"Peak per rank: {titled}", charts.memory_peaks(group, ref, setting), f"memory-peak-{i}")
        )
        section.blocks.append(_peak_table(group, ref, titled))
        group_parts = parts[parts["setting"] == setting] if not parts.empty else parts
        if not group_parts.empty:
            section.blocks.append(
                Chart(
                    f"Breakdown of the peak: {titled}",
                    charts.memory_breakdown(group_parts, setting),
                    f"memory-breakdown-{i}",
                )
            )
            section.blocks.append(_breakdown_table(group_parts, titled))
        if group["layers"].nunique() > 1:
            section.blocks.append(depth_table(group, ref, data.configs, titled))
    section.blocks += _memory_predicted(peaks)
    section.blocks += _sharded(peaks, data.configs)
    return section


SHARDED_DP = (1, 2, 4, 8, 16, 32, 64)


def _sharded(peaks: pd.DataFrame, configs: dict[int, dict]) -> list[Table | Chart]:
    """Sharded DP, predicted (tpbench.predict.theory.sharding): per setting, the peak per rank of DDP,
    ZeRO-1, ZeRO-2 and FSDP against DP at the TP of its widest run, the micro-batch per rank kept."""
    from tpbench.labels import LEVEL_NAMES
    from tpbench.predict import theory
    from tpbench.predict.theory.sharding import GRADS, PARAMS

    blocks: list[Table | Chart] = []
    for i, (setting, group) in enumerate(peaks.groupby("setting", sort=False)):
        known = group[group["id"].isin(list(configs))]
        if known.empty:
            continue
        # the widest run's config alone made typed (0.1-0.3 s a config): the first of the largest tp, L
        widest = known.sort_values(["tp", "layers"], ascending=False, kind="stable")["id"].iloc[0]
        cfg = run_config(configs[widest])
        train = dataclasses.replace(cfg.train, batch="fixed_per_rank", micro_batch=local_batch(cfg))
        rows = []
        for dp in SHARDED_DP:
            for level, name in LEVEL_NAMES.items():
                if dp == 1 and level != "none":
                    continue
                parallel = dataclasses.replace(cfg.parallel, dp=dp, dp_shard=level, dp_replicate=1)
                p = theory.predict(dataclasses.replace(cfg, parallel=parallel, train=train))
                dp_bytes = sum(r.bytes for r in p.comm_rows() if r.purpose in (GRADS, PARAMS))
                rows.append({"level": name, "dp": dp, "peak_bytes": p.peak_bytes, "DP bytes/step": dp_bytes})
        frame = pd.DataFrame(rows)
        shape = f"{mode_label(cfg.parallel)} tp={cfg.parallel.tp} L{cfg.model.num_hidden_layers}"
        title = f"Sharded DP, predicted: {shape}: {setting}"
        note = "The analytic model of each level at the same micro-batch per rank."
        blocks.append(Chart(title, charts.sharded_peaks(frame, title), f"memory-sharded-{i}", note=note))
        formats = {"peak_bytes": units.mib, "DP bytes/step": units.mib}
        blocks.append(Table(title, frame, formats))
    return blocks


def _peak_table(group: pd.DataFrame, ref: pd.DataFrame, setting: str) -> Table:
    frame = pd.DataFrame(
        {
            "layers": group["layers"],
            "mode": group["label"],
            "layout": group["layout"],
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
        keys = list(zip(group["layers"], group["label"], strict=True))  # the seed's: DDP's replicas
        frame[published.SEED] = [ref_peak.get(k) for k in keys]
        frame["ours / published"] = frame["peak / rank"] / frame[published.SEED]
        formats |= {published.SEED: units.mib, "ours / published": units.percent}
        note = (
            f"{published.SEED}: the tensor-parallel chapter of github.com/ANKer661/minimind, measured on "
            "GPUs there; same config."
        )
    return Table(f"Peak per rank: {setting}", frame, formats, note)


def _breakdown_table(parts: pd.DataFrame, setting: str) -> Table:
    index = ["layers", "mode_rank", "level_rank", "label"]
    wide = parts.pivot_table(index=index, columns="part", values="measured_bytes", sort=False)
    wide = wide.sort_index().reset_index().drop(columns=["mode_rank", "level_rank"])
    wide = wide.rename(columns={"label": "mode"})
    wide.columns.name = None
    if parts["predicted_bytes"].fillna(0).gt(0).any():
        predicted = parts.pivot_table(index=index, columns="part", values="predicted_bytes", sort=False)
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
            "mode": rows["label"],
            "layout": rows["layout"],
            "measured": rows["peak_bytes"],
            "predicted": rows["predicted_peak_bytes"],
            "error": rows["predicted_error"],
        }
    )
    formats = {"measured": units.mib, "predicted": units.mib, "error": units.signed_percent}
    blocks.append(Table("Measured vs predicted peak", frame, formats))
    return blocks


def depth_fit(layers: pd.Series, peaks: pd.Series) -> tuple[float, float, float]:
    """The least-squares line through a mode's peaks over depth: F, the slope per layer, and its
    largest miss, relative to the peak it misses."""
    slope, F = np.polyfit(layers.astype(float), peaks.astype(float), 1)
    miss = (peaks - (F + slope * layers)).abs() / peaks
    return float(F), float(slope), float(miss.max())


def depth_table(group: pd.DataFrame, ref: pd.DataFrame, configs: dict[int, dict], setting: str) -> Table:
    """One row per mode with runs at several depths: its measured line (fitted), the split the theory
    predicts for its deepest run, its ratio to DDP at each depth and as L grows; and the seed's
    published DDP and TP beside, where the setting is the seed's."""
    depths = sorted(group["layers"].unique())
    ddp = group[group["label"] == "ddp"]
    ddp_slope = depth_fit(ddp["layers"], ddp["peak_bytes"])[1] if ddp["layers"].nunique() > 1 else np.nan
    ddp_deepest = ddp.loc[ddp["layers"].idxmax(), "id"] if not ddp.empty else None
    rows = []
    for mode, runs in group.groupby("label", sort=False):
        if runs["layers"].nunique() < 2:
            continue
        F, slope, miss = depth_fit(runs["layers"], runs["peak_bytes"])
        row = {"mode": mode, "F (fit)": F, "per layer (fit)": slope, "largest miss": miss}
        deepest = runs.loc[runs["layers"].idxmax(), "id"]
        row |= _predicted(_config(configs, deepest), _config(configs, ddp_deepest))
        row |= {f"of DDP, L{L}": runs.loc[runs["layers"] == L, "of_ddp"].max() for L in depths}
        row["slope / DDP's (fit)"] = slope / ddp_slope
        rows.append(row)
    for mode, runs in ref.groupby("mode", sort=False) if not ref.empty else ():
        ref_ddp = ref[ref["mode"] == "ddp"].set_index("layers")["peak_bytes"]
        F, slope, miss = depth_fit(runs["layers"], runs["peak_bytes"])
        row = {
            "mode": f"{mode}: {published.SEED}",
            "F (fit)": F,
            "per layer (fit)": slope,
            "largest miss": miss,
        }
        row |= {
            f"of DDP, L{L}": p / ref_ddp.get(L, np.nan)
            for L, p in zip(runs["layers"], runs["peak_bytes"], strict=True)
        }
        row["slope / DDP's (fit)"] = slope / depth_fit(ref_ddp.index.to_series(), ref_ddp)[1]
        rows.append(row)
    frame = pd.DataFrame(rows)
    limit = frame.pop("limit vs DDP (predicted)") if "limit vs DDP (predicted)" in frame else np.nan
    frame["limit vs DDP (predicted)"] = limit  # beside the measured ratios it is the limit of
    mib = ("F (fit)", "per layer (fit)", "F", "a", "r", "a/T + r")
    formats = {c: units.mib for c in mib} | {
        c: units.percent for c in frame.columns if c.startswith("of DDP")
    }
    formats |= {"largest miss": lambda v: units.DASH if pd.isna(v) else f"{v:.2%}"}
    formats |= {c: units.percent for c in ("slope / DDP's (fit)", "limit vs DDP (predicted)")}
    note = (
        "Peak per rank = F + L (a/T + r): F does not grow with depth, a is what each layer adds that TP "
        "divides by T (counted whole), r what it leaves whole on every rank (tpbench.predict.theory.depth). "
        "Fit: least squares over the runs' depths (largest miss: the worst run off the line). F, a, r "
        "and the limit are predicted for the deepest run; limit vs DDP = (a/T + r) over DDP's a + r, "
        "the ratio of the peaks as L grows, which the measured ratios approach."
    )
    return Table(f"Peak over depth: {setting}", frame, formats, note)


def _config(configs: dict[int, dict], run_id: object) -> RunConfig | None:
    return run_config(configs[run_id]) if run_id in configs else None


def _predicted(cfg: RunConfig | None, ddp: RunConfig | None) -> dict[str, float]:
    """The theory's split of a run's peak, and its limit against the setting's DDP run (or, with
    none, DDP in the run's world)."""
    if cfg is None:
        return {}
    limit = depth.limits({"ddp": ddp or depth.mode_configs(cfg)["ddp"], "run": cfg})[-1]
    s = limit.split
    return {"F": s.F, "a": s.a, "r": s.r, "a/T + r": s.per_layer, "limit vs DDP (predicted)": limit.vs_ddp}
