"""The report's content, whatever its format: sections of tables and charts built from ReportData.

A `Table` keeps raw values and one formatter per column (units come from tpbench.report.units), so
HTML (pandas Styler) and Markdown show the same text. Charts are PNG bytes (tpbench.report.charts).
A section with nothing to show says so in one line instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
from omegaconf import OmegaConf

from tpbench.config import RunConfig
from tpbench.report import charts, published, units
from tpbench.report.data import (
    ReportData,
    comm_predicted,
    drift,
    memory_breakdown,
    memory_peaks,
    mode_rank,
    recompute,
    throughput,
    validation,
)
from tpbench.report.data import collectives as collectives_frame

Formatter = Callable[[object], str]


@dataclass
class Table:
    title: str
    frame: pd.DataFrame  # raw values; the column names are what the reader sees
    formats: dict[str, Formatter] = field(default_factory=dict)
    note: str = ""
    verdict: str | None = None  # a column of passed / FAILED, coloured in HTML

    def display(self) -> pd.DataFrame:
        """Every cell as the text the reader sees."""
        return pd.DataFrame(
            {col: self.frame[col].map(self.formats.get(col, units.text)) for col in self.frame.columns},
            index=self.frame.index,
        )


@dataclass
class Chart:
    title: str
    png: bytes
    name: str  # file stem when written beside a Markdown report
    note: str = ""


@dataclass
class Diagram:
    """One block of a mode, drawn by `tpbench diagram` (an SVG file's bytes)."""

    title: str
    svg: bytes
    name: str  # file stem when written beside a Markdown report
    note: str = ""


@dataclass
class Section:
    id: str
    title: str
    intro: str = ""
    blocks: list[Table | Chart | Diagram] = field(default_factory=list)
    empty: str = ""  # shown instead of the blocks when there are none


def build(data: ReportData) -> list[Section]:
    return [
        header(data),
        memory(data),
        recompute_section(data),
        throughput_section(data),
        communication(data),
        diagrams(data),
        validation_section(data),
    ]


def _kind_empty(data: ReportData, kind: str) -> str:
    failed = int((data.failed["kind"] == kind).sum())
    tail = f" ({failed} failed: see the header)" if failed else ""
    return f"No OK {kind} runs in this selection{tail}."


# -- header ------------------------------------------------------------------------------------------


def header(data: ReportData) -> Section:
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
            modes=("mode", lambda m: ", ".join(sorted(set(m), key=_mode_key))),
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
        cols = ["id", "started_at", "kind", "mode", "sweep", "status", "failed_rank", "error", "log_dir"]
        blocks.append(
            Table(
                f"Runs that did not end OK ({failed})",
                data.failed[cols].rename(columns={"started_at": "started (UTC)"}),
                {"started (UTC)": lambda t: f"{t:%Y-%m-%d %H:%M}", "failed_rank": _int},
            )
        )
    intro = (
        f"Mixed hardware: these runs ran on {len(kinds)} kinds of machine ({'; '.join(kinds)}). Each setting "
        f"below names its hardware, and figures are compared within one setting only."
        if mixed
        else ""
    )
    return Section("header", "tpbench report: DDP vs TP vs SP vs VP", intro, blocks)


# -- memory ------------------------------------------------------------------------------------------


def memory(data: ReportData) -> Section:
    section = Section(
        "memory",
        "Memory",
        intro="Per-rank peak of training steps after warm-up (the busiest rank), by layer count. "
        "On each bar: the change against DDP in the same setting.",
    )
    peaks = memory_peaks(data)
    if peaks.empty:
        section.empty = _kind_empty(data, "memory")
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
        note = f"{published.SEED}: REFERENCE.md section 6, measured on GPUs elsewhere; same config."
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


# -- activation recompute ----------------------------------------------------------------------------


def recompute_section(data: ReportData) -> Section:
    section = Section(
        "recompute",
        "Activation recompute",
        intro="train.recompute = none, selective (the SwiGLU's product made again in backward), full "
        "(each block run again from its input): per-rank peak (memory runs) and "
        "median step time (throughput runs) of each setting, against the same mode without recompute.",
    )
    frame = recompute(data)
    if frame.empty:
        section.empty = "No config was measured with more than one train.recompute setting."
        return section
    for i, (setting, group) in enumerate(frame.groupby("base_setting", sort=False)):
        section.blocks.append(
            Chart(f"Recompute: {setting}", charts.recompute(group, setting), f"recompute-{i}")
        )
        columns = {
            "layers": ("layers", None),
            "mode": ("mode", None),
            "recompute": ("recompute", None),
            "memory run": ("memory_run", _int),
            "peak / rank": ("peak_bytes", units.mib),
            "predicted": ("predicted_peak_bytes", units.mib),
            "peak of none": ("peak_of_none", units.percent),
            "throughput run": ("throughput_run", _int),
            "step time": ("step_time_s", units.ms),
            "p10": ("step_time_p10_s", units.ms),
            "p90": ("step_time_p90_s", units.ms),
            "step of none": ("step_of_none", units.ratio),
            "executed FLOPs / step": ("flops_per_step", units.flops),
            "predicted recompute FLOPs": ("predicted_recompute_flops_per_step", units.flops),
        }
        section.blocks.append(_pick(f"Recompute: {setting}", group, columns))
    return section


# -- throughput --------------------------------------------------------------------------------------


def throughput_section(data: ReportData) -> Section:
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
        section.empty = _kind_empty(data, "throughput")
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
            "timed by": ("timing_cuda_events", _timed_by),
        }
        section.blocks.append(_pick(f"Throughput: {setting}", group, columns))
    return section


# -- communication -----------------------------------------------------------------------------------


def communication(data: ReportData) -> Section:
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
        section.blocks.append(
            Chart(f"Collectives per step: {setting}", charts.collectives(group, setting), f"comm-{i}")
        )
        table = pd.DataFrame(
            {
                "layers": group["layers"],
                "mode": group["mode"],
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
        section.blocks.append(Table(f"Collectives per step: {setting}", table, formats))
    predicted = comm_predicted(data)
    if not predicted.empty:
        columns = {
            "setting": ("setting", None),
            "layers": ("layers", None),
            "mode": ("mode", None),
            "kind": ("kind", None),
            "measured": ("comm_bytes_per_step", units.size),
            "predicted": ("predicted_comm_bytes_per_step", units.size),
            "error": ("error", units.signed_percent),
        }
        section.blocks.append(_pick("Bytes per step per rank, measured vs predicted", predicted, columns))
    return section


# -- diagrams ----------------------------------------------------------------------------------------

DRAWN_MODES = ("tp", "tp_sp", "tp_sp_linear", "tp_vp", "tp_sp_vp")


def diagrams(data: ReportData) -> Section:
    """One block of each of tpbench's TP modes shown, from the latest OK run of the mode: its config
    traced for one step with one layer (and one TP group), every rank emulated in this process."""
    from tpbench import diagram  # torch and graphviz load only when a report draws one

    section = Section(
        "diagrams",
        "Diagrams",
        intro="One transformer block of each mode, drawn by `tpbench diagram` from a traced training step "
        "of the run's config: each rank's weight shards (math view W [in, out], nn.Linear view weight "
        "[out, in]), the per-rank activation shapes, and every collective (#n in issue order, forward in "
        "blue, backward in red) with its type, group and bytes.",
    )
    ok = data.ok[data.ok["mode"].isin(DRAWN_MODES) & (data.ok["tp"] > 1)]
    for mode in sorted(ok["mode"].unique(), key=mode_rank):
        run_id = int(ok.loc[ok["mode"] == mode, "id"].max())
        cfg = run_config(data.configs[run_id])
        cfg.parallel.dp = 1
        traced = diagram.trace(diagram.traceable(cfg))
        section.blocks.append(
            Diagram(
                f"{mode} at T = {cfg.parallel.tp}",
                diagram.render([traced], "svg"),
                f"diagram-{mode}",
                f"config of run {run_id}, one layer, one TP group; "
                f"`tpbench diagram` with the run's overrides draws the same",
            )
        )
    if not section.blocks:
        section.empty = "No OK run of tp, tp_sp, tp_vp or tp_sp_vp with tp > 1 in this selection."
    return section


def run_config(flat: dict) -> RunConfig:
    """A stored run's config (flattened, as ReportData keeps it) as a typed RunConfig."""
    nested: dict = {}
    for key, value in flat.items():
        *parents, name = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), nested))  # type: ignore[return-value]


# -- validation --------------------------------------------------------------------------------------


def validation_section(data: ReportData) -> Section:
    section = Section(
        "validation",
        "Validation",
        intro="Each parallel model against the dense model built from the same weights and fed the same "
        "tokens: forward logits and loss, every gradient, then AdamW steps (logits on a fixed batch, final "
        "parameters).",
    )
    runs = validation(data)
    if runs.empty:
        section.empty = _kind_empty(data, "validate")
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
    table = _pick("Checks against dense", runs, columns)
    table.verdict = "verdict"
    if any(published.seed_check_matches(run) for _, run in runs.iterrows()):
        seed = published.SEED_CHECK
        row = {"run": published.SEED, "mode": "tp", "tp×dp": "2×1", "layers": 6, "AdamW steps": 200}
        row |= {label: seed.get(key) for label, (key, _) in columns.items() if key in seed}
        row["AdamW max |logits diff|"] = seed["adamw_logits_max_abs"]
        table.frame = pd.concat([table.frame, pd.DataFrame([row])], ignore_index=True)[table.frame.columns]
        table.note = f"Last row: {published.SEED}, REFERENCE.md section 6, on the same config."
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


# -- helpers -----------------------------------------------------------------------------------------


def _pick(title: str, frame: pd.DataFrame, columns: dict[str, tuple[str, Formatter | None]]) -> Table:
    """A table of the columns the frame has: {label: (column, formatter)}."""
    present = {label: (col, fmt) for label, (col, fmt) in columns.items() if col in frame}
    table = pd.DataFrame({label: frame[col].to_numpy() for label, (col, _) in present.items()})
    formats = {label: fmt for label, (_, fmt) in present.items() if fmt is not None}
    return Table(title, table, formats)


def _int(value: object) -> str:
    return units.DASH if value is None or pd.isna(value) else f"{int(value)}"


def _timed_by(value: object) -> str:
    """The metric timing_cuda_events: how a throughput run took its times (tpbench.parallel.timing)."""
    return units.DASH if value is None or pd.isna(value) else "CUDA events" if value else "wall clock"


def _mode_key(mode: str) -> tuple[int, str]:
    return mode_rank(mode), mode
