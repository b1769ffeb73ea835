"""What a report shows: the selected runs, and one tidy frame per section.

`load` reads the database once (runs, headline metrics, curves, collectives, configs); the other
functions are pure pandas over the `ReportData` it returns, one frame per chart or table.
A *setting* is everything two runs must share to be compared across modes (shape, batch, dtype,
world size, hardware: tpbench.predict.hardware); the number of layers is kept apart, because the memory
figures plot it. A config is shown once per hardware it ran on: its latest OK run there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import pandas as pd
from sqlalchemy.engine import make_url

from tpbench.config import emulation_label
from tpbench.db import ResultsDB, parse_since
from tpbench.report.labels import MODE_ORDER as MODE_ORDER  # re-exported: what the report calls a run
from tpbench.report.labels import mode_rank as mode_rank
from tpbench.report.labels import model_label, optimizer_setting, setting_label, switches, with_dp_level

RECOMPUTE_ORDER = ("none", "selective", "op", "full")
# MemTracker's split of the peak, bottom to top of the stacked bars; the last two are often zero.
MEMORY_PARTS = {
    "mem_params_bytes": "parameters",
    "mem_grads_bytes": "gradients",
    "mem_optimizer_bytes": "optimizer",
    "mem_activations_bytes": "activations",
    "mem_temporaries_bytes": "temporaries",
    "mem_buffers_bytes": "buffers",
    "mem_other_bytes": "other",
}
# Which kind's collectives stand for a config in the communication section, best first:
# the training steps of throughput and memory count the optimizer's DP all-reduce too.
COMM_KIND_PREFERENCE = ("throughput", "memory", "validate")


class SelectionError(ValueError):
    """A filter the report cannot apply; one line says why."""


@dataclass
class Selection:
    """The filters of `tpbench report`: every one given must hold."""

    sweep: str | None = None
    kind: str | None = None
    mode: str | None = None
    since: datetime | None = None
    where: dict[str, str] = field(default_factory=dict)
    device: str | None = None  # a substring of the hardware, any case (tpbench.db.ResultsDB.runs)

    @classmethod
    def parse(
        cls,
        sweep: str | None = None,
        kind: str | None = None,
        mode: str | None = None,
        since: str | None = None,
        where: list[str] | None = None,
        device: str | None = None,
    ) -> Selection:
        """From the command line's strings; raises SelectionError on a bad --since or --where."""
        try:
            start = parse_since(since) if since else None
        except ValueError:
            raise SelectionError(
                f"--since={since}: accepted are an ISO date or time such as 2026-11-30T08:00, or 30m, 12h, 7d"
            ) from None
        pairs = {}
        for item in where or []:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise SelectionError(f"--where {item}: expected key=value, e.g. --where layers=8")
            pairs[key.strip()] = value.strip()
        return cls(sweep, kind, mode, start, pairs, device)

    def describe(self) -> str:
        parts = [
            f"{k}={v}" for k, v in (("sweep", self.sweep), ("kind", self.kind), ("mode", self.mode)) if v
        ]
        if self.since:
            parts.append(f"since {self.since:%Y-%m-%d %H:%M} UTC")
        parts += [f"{k}={v}" for k, v in self.where.items()]
        if self.device:
            parts.append(f"hardware holding {self.device!r}")
        return ", ".join(parts) or "every run"


@dataclass
class ReportData:
    """The selected runs and what they measured (curves and collectives of OK runs only)."""

    db_url: str
    selection: Selection
    runs: pd.DataFrame  # one row per run, every status, + setting label + headline metrics
    curves: pd.DataFrame  # run_id, name, step, value: max over ranks
    per_rank: pd.DataFrame  # run_id, rank, name, value: per-run figures of every rank
    comm: pd.DataFrame  # run_id, rank, op, purpose, count, bytes, time_s, exposed_s
    configs: dict[int, dict] = field(default_factory=dict)  # run id -> flat config ("model.name": ...)
    generated_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    # per-parameter errors of the OK validate runs (tpbench.results.ParamRow), rank 0's: run_id, name, ...
    params: pd.DataFrame = field(default_factory=pd.DataFrame)

    def __post_init__(self) -> None:
        if "label" not in self.runs:  # runs built by hand: their DP level from the configs given
            self.runs = with_dp_level(self.runs, self.configs)

    @property
    def ok(self) -> pd.DataFrame:
        return self.runs[self.runs["status"] == "OK"]

    @property
    def failed(self) -> pd.DataFrame:
        return self.runs[self.runs["status"] != "OK"]


def load(db: ResultsDB, selection: Selection) -> ReportData:
    """Read the runs the selection names, with everything the sections need."""
    s = selection
    runs = db.runs(kind=s.kind, mode=s.mode, since=s.since, sweep=s.sweep, device=s.device)
    configs = _configs(db, runs["id"].tolist())
    if s.where:
        runs = runs[_where_mask(runs, configs, s.where)]
        configs = {i: configs[i] for i in runs["id"]}
    ok_ids = runs.loc[runs["status"] == "OK", "id"].tolist()
    metrics = db.metrics(ok_ids)
    runs = runs.join(metrics, on="id")
    # emulated runs (tpbench.parallel.emulation) are a setting of their own: never drawn beside measured jobs
    runs["emulated"] = [emulation_label(configs[i]) for i in runs["id"]]
    runs["model"] = [model_label(configs.get(i, {})) for i in runs["id"]]
    runs["recompute"] = [configs.get(i, {}).get("train.recompute", "none") for i in runs["id"]]
    # the step's speed switches (the throughput section's axes), "" when none is on
    runs["switches"] = [switches(configs.get(i, {})) for i in runs["id"]]
    runs["base_setting"] = runs.apply(setting_label, axis=1) if len(runs) else pd.Series(dtype=str)
    # runs of other weight-decay groups or an lr schedule (what they train differs) are their own setting
    trained = pd.Series(
        [optimizer_setting(configs.get(i, {})) for i in runs["id"]], index=runs.index, dtype=str
    )
    runs["base_setting"] = runs["base_setting"] + trained.map(lambda t: f" · {t}" if t else "")
    # runs with activation recompute are their own setting in every section but the recompute one
    suffix = runs["recompute"].map(lambda r: "" if r == "none" else f" · recompute {r}")
    runs["setting"] = runs["base_setting"] + suffix
    long = db.measurements(ok_ids)
    curves = long[long["step"].notna()].groupby(["run_id", "name", "step"], as_index=False)["value"].max()
    per_rank = long[long["step"].isna()][["run_id", "rank", "name", "value"]]
    comm = db.comm(ok_ids)
    url = make_url(db.url).render_as_string(hide_password=True)  # a report may travel
    validated = runs.loc[(runs["status"] == "OK") & (runs["kind"] == "validate"), "id"].tolist()
    params = db.param_errors(validated)
    params = params[params["rank"] == 0]
    return ReportData(url, s, runs.reset_index(drop=True), curves, per_rank, comm, configs, params=params)


def latest(data: ReportData, kind: str) -> pd.DataFrame:
    """The OK runs of a kind, the latest one of each config on each hardware, in mode order."""
    runs = data.ok[data.ok["kind"] == kind]
    runs = runs.sort_values("id").drop_duplicates(["config_hash", "hardware"], keep="last")
    order = [
        "setting",
        "layers",
        "mode_rank",
        "level_rank",
        *(["switches"] if "switches" in runs else []),
        "id",
    ]
    return runs.sort_values(order).reset_index(drop=True)


# -- memory ------------------------------------------------------------------------------------------


def memory_peaks(data: ReportData) -> pd.DataFrame:
    """Per-rank peak of every memory run (the highest rank's), its ranks' spread, and its ratio to
    DDP's peak in the same setting and layer count (NaN where no DDP run matches)."""
    runs = latest(data, "memory")
    if runs.empty:
        return runs
    peaks = data.per_rank[data.per_rank["name"] == "peak_bytes"].groupby("run_id")["value"]
    runs = runs.assign(
        peak_min_bytes=runs["id"].map(peaks.min()),
        ranks=runs["id"].map(peaks.count()),
    )
    ddp = runs[runs["label"] == "ddp"].drop_duplicates(["setting", "layers"], keep="last")
    ddp_peak = ddp.set_index(["setting", "layers"])["peak_bytes"].rename("ddp_peak_bytes")
    runs = runs.join(ddp_peak, on=["setting", "layers"])
    runs["of_ddp"] = runs["peak_bytes"] / runs["ddp_peak_bytes"]
    if "predicted_peak_bytes" in runs:
        runs["predicted_error"] = runs["predicted_peak_bytes"] / runs["peak_bytes"] - 1
    return runs


def memory_breakdown(data: ReportData) -> pd.DataFrame:
    """Long form: run, setting, layers, mode, part, measured bytes (and predicted where recorded),
    taken on the rank with the highest peak so that the parts add up to that rank's total."""
    runs = latest(data, "memory")
    if runs.empty:
        return pd.DataFrame()
    figures = data.per_rank[data.per_rank["run_id"].isin(runs["id"])]
    peaks = figures[figures["name"] == "peak_bytes"]
    top_rank = peaks.loc[peaks.groupby("run_id")["value"].idxmax(), ["run_id", "rank"]]
    figures = figures.merge(top_rank, on=["run_id", "rank"])
    wide = figures.pivot_table(index="run_id", columns="name", values="value", aggfunc="max")
    rows = []
    for run in runs.itertuples():
        if run.id not in wide.index:
            continue
        for name, part in MEMORY_PARTS.items():
            measured = wide.at[run.id, name] if name in wide else float("nan")
            predicted_name = f"predicted_{name}"
            predicted = wide.at[run.id, predicted_name] if predicted_name in wide else float("nan")
            if pd.isna(measured) and pd.isna(predicted):
                continue
            rows.append(
                {
                    "run_id": run.id,
                    "setting": run.setting,
                    "layers": run.layers,
                    "mode": run.mode,
                    "label": run.label,
                    "mode_rank": run.mode_rank,
                    "level_rank": run.level_rank,
                    "part": part,
                    "measured_bytes": measured,
                    "predicted_bytes": predicted,
                }
            )
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    # parts that are zero in every run (buffers, other) only clutter the legend
    used = frame.groupby("part")["measured_bytes"].apply(lambda v: (v.fillna(0) > 0).any())
    return frame[frame["part"].map(used) | frame["predicted_bytes"].fillna(0).gt(0)]


# -- activation recompute ----------------------------------------------------------------------------


def recompute(data: ReportData) -> pd.DataFrame:
    """Per setting (recompute apart), layers, mode and recompute setting: the latest memory run's peak
    (measured, predicted) and the latest throughput run's step time, each also as a ratio to the
    same mode with recompute none. Only configs measured with more than one recompute setting."""
    keys = ["base_setting", "layers", "mode", "label", "level_rank", "recompute"]
    if "recompute" not in data.runs:  # runs built by hand, without configs
        return pd.DataFrame()
    memory = latest(data, "memory")
    speed = latest(data, "throughput")
    if memory.empty and speed.empty:
        return pd.DataFrame()
    columns = {
        "memory": (memory, ["id", "peak_bytes", "predicted_peak_bytes"]),
        "throughput": (speed, ["id", "step_time_s", "step_time_p10_s", "step_time_p90_s", "flops_per_step",
                               "predicted_recompute_flops_per_step"]),
    }  # fmt: skip
    frames = []
    for kind, (runs, wanted) in columns.items():
        present = [c for c in wanted if c in runs]
        frames.append(runs[keys + ["mode_rank", *present]].rename(columns={"id": f"{kind}_run"}))
    frame = frames[0].merge(frames[1], on=[*keys, "mode_rank"], how="outer")
    settings = frame.groupby(["base_setting", "layers", "label"])["recompute"].transform("nunique")
    frame = frame[settings > 1]
    if frame.empty:
        return frame
    none = frame[frame["recompute"] == "none"].set_index(["base_setting", "layers", "label"])
    index = pd.MultiIndex.from_frame(frame[["base_setting", "layers", "label"]])
    for column, ratio in (("peak_bytes", "peak_of_none"), ("step_time_s", "step_of_none")):
        if column in frame and column in none:
            frame[ratio] = frame[column].to_numpy() / none[column].reindex(index).to_numpy()
    frame["recompute_rank"] = frame["recompute"].map(
        lambda r: RECOMPUTE_ORDER.index(r) if r in RECOMPUTE_ORDER else len(RECOMPUTE_ORDER)
    )
    order = ["base_setting", "layers", "mode_rank", "level_rank", "recompute_rank"]
    return frame.sort_values(order).reset_index(drop=True)


# -- throughput and communication --------------------------------------------------------------------


def throughput(data: ReportData) -> pd.DataFrame:
    """The throughput runs shown, with of_ddp: tokens/s as a fraction of DDP's in the same setting,
    layers and switches (NaN where no DDP run matches)."""
    runs = latest(data, "throughput")
    if runs.empty or "tokens_per_s" not in runs:
        return runs
    keys = ["setting", "layers", *(["switches"] if "switches" in runs else [])]
    ddp = runs[runs["label"] == "ddp"].drop_duplicates(keys, keep="last").set_index(keys)["tokens_per_s"]
    runs = runs.join(ddp.rename("ddp_tokens_per_s"), on=keys)
    return runs.assign(of_ddp=runs["tokens_per_s"] / runs["ddp_tokens_per_s"], **machine_load(runs))


LOADED_RULE = (
    "A run marked loaded was timed on a machine with more runnable work than cores: its load average "
    "(1 minute) before the run's job started was above its cores, so its ranks shared them with other "
    "work and its times are longer than the machine's own"
)


def machine_load(runs: pd.DataFrame) -> dict[str, pd.Series]:
    """`loaded` (LOADED_RULE; False where the run recorded no load, a run before the metric) and
    `machine_load`, e.g. "loaded: 3.8 on 2 cores", from the metrics load_before_job and cpu_cores."""
    if "load_before_job" not in runs:
        return {
            "loaded": pd.Series(False, index=runs.index),
            "machine_load": pd.Series(None, index=runs.index),
        }
    load, cores = runs["load_before_job"], runs["cpu_cores"]
    loaded = (load > cores).fillna(False)
    text = [
        None if pd.isna(v) else f"{'loaded: ' if hot else ''}{v:.1f} on {c:.0f} cores"
        for v, c, hot in zip(load, cores, loaded, strict=True)
    ]
    return {"loaded": loaded.astype(bool), "machine_load": pd.Series(text, index=runs.index, dtype=object)}


def collectives(data: ReportData) -> pd.DataFrame:
    """Per config, the collectives of one training step: op, purpose, count and bytes on the wire
    per rank (the busiest rank), from the latest OK run of the preferred kind."""
    if data.comm.empty:
        return pd.DataFrame()
    runs = data.ok[data.ok["id"].isin(data.comm["run_id"])].copy()
    runs["preference"] = runs["kind"].map(
        lambda k: COMM_KIND_PREFERENCE.index(k) if k in COMM_KIND_PREFERENCE else 99
    )
    runs = runs.sort_values(["preference", "id"], ascending=[True, False])
    switched = ["switches"] if "switches" in runs else []
    chosen = runs.drop_duplicates(["setting", "layers", "label", *switched]).sort_values(
        ["setting", "layers", "mode_rank", "level_rank", *switched]
    )
    comm = data.comm[data.comm["run_id"].isin(chosen["id"])]
    per_op = comm.groupby(["run_id", "op", "purpose"], as_index=False).agg(
        count=("count", "max"),
        bytes=("bytes", "max"),
        time_s=("time_s", "max"),
        exposed_s=("exposed_s", "max"),
    )
    keep = [
        "id",
        "kind",
        "setting",
        "layers",
        "mode",
        "label",
        "layout",
        "mode_rank",
        "level_rank",
        *switched,
    ]
    frame = chosen[keep].rename(columns={"id": "run_id"}).merge(per_op, on="run_id")
    order = ["setting", "layers", "mode_rank", "level_rank", "op", "purpose"]
    return frame.sort_values(order).reset_index(drop=True)


def comm_predicted(data: ReportData) -> pd.DataFrame:
    """Measured against predicted bytes per step, for the runs that recorded a prediction."""
    runs = data.ok
    if "predicted_comm_bytes_per_step" not in runs or "comm_bytes_per_step" not in runs:
        return pd.DataFrame()
    # a prediction of zero bytes is no prediction (a placeholder model), not a 100% error
    runs = runs[runs["predicted_comm_bytes_per_step"].fillna(0).gt(0) & runs["comm_bytes_per_step"].notna()]
    runs = runs.sort_values("id").drop_duplicates(["setting", "layers", "label", "kind"], keep="last")
    runs = runs.assign(error=runs["predicted_comm_bytes_per_step"] / runs["comm_bytes_per_step"] - 1)
    return runs.sort_values(["setting", "layers", "mode_rank", "level_rank", "kind"]).reset_index(drop=True)


# -- validation --------------------------------------------------------------------------------------


def validation(data: ReportData) -> pd.DataFrame:
    runs = latest(data, "validate")
    if runs.empty:
        return runs
    configs = [data.configs.get(i, {}) for i in runs["id"]]
    return runs.assign(
        adamw_steps=[c.get("validate.steps") for c in configs],
        validate_batch=[c.get("validate.batch", "fresh") for c in configs],  # runs before the option: fresh
    )


def drift(data: ReportData) -> pd.DataFrame:
    """The AdamW logits drift curve of every validate run shown: run, mode, step, value."""
    runs = validation(data)
    curve = data.curves[data.curves["name"] == "adamw_logits_max_abs"]
    keep = ["id", "mode", "label", "mode_rank", "level_rank", "setting", "layers"]
    frame = runs[keep].rename(columns={"id": "run_id"}).merge(curve, on="run_id")
    return frame.sort_values(["mode_rank", "level_rank", "run_id", "step"]).reset_index(drop=True)


DRIFT = {"adamw_logits_mean_abs": "mean", "adamw_logits_max_abs": "max", "adamw_logits_rel_l2": "rel_l2"}
# the gradients at every step, at the same weights (not free-running): the worst parameter's
STEP_GRAD = {"step_grad_max_rel_l2": "rel_l2", "step_grad_of_bound": "of_bound"}


def drift_table(data: ReportData, names: dict[str, str] = DRIFT) -> pd.DataFrame:
    """The logits drift of every validate run shown, one row per compared step: run_id, mode,
    validate_batch, step, mean, max, rel_l2 (runs before the mean and relative L2 were recorded: NaN).
    With `names` STEP_GRAD: the per-step gradient check instead, rel_l2 and of_bound per step."""
    runs = validation(data)
    curve = data.curves[data.curves["name"].isin(list(names))]
    if runs.empty or curve.empty:
        return pd.DataFrame()
    wide = curve.pivot_table(index=["run_id", "step"], columns="name", values="value", aggfunc="max")
    wide = wide.rename(columns=names).reindex(columns=list(names.values())).reset_index()
    keep = ["id", "mode", "label", "mode_rank", "level_rank", "setting", "layers", "validate_batch"]
    frame = runs[keep].rename(columns={"id": "run_id"}).merge(wide, on="run_id")
    return frame.sort_values(["setting", "mode_rank", "level_rank", "run_id", "step"]).reset_index(drop=True)


# -- raw rows ----------------------------------------------------------------------------------------


def raw_rows(data: ReportData) -> pd.DataFrame:
    """csv / json: every selected run joined with its headline metrics."""
    return data.runs.drop(columns=["mode_rank", "level_rank"], errors="ignore")


# -- selection helpers -------------------------------------------------------------------------------


def _configs(db: ResultsDB, ids: list[int]) -> dict[int, dict]:
    return {run_id: _flatten(config) for run_id, config in db.configs(ids).items()} if ids else {}


def _flatten(node: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in node.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _where_mask(runs: pd.DataFrame, configs: dict[int, dict], where: dict[str, str]) -> pd.Series:
    mask = pd.Series(True, index=runs.index)
    config_keys = set().union(*configs.values()) if configs else set()
    for key, wanted in where.items():
        if key in runs.columns:
            values = runs[key]
        elif key in config_keys:
            values = runs["id"].map(lambda i, k=key: configs[i].get(k))
        elif runs.empty:
            continue
        else:
            raise SelectionError(
                f"--where {key}=...: neither a run column ({', '.join(c for c in runs.columns)}) "
                f"nor a config key such as model.name or validate.steps"
            )
        mask &= values.map(lambda actual, w=wanted: _matches(actual, w))
    return mask


def _matches(actual: object, wanted: str) -> bool:
    """`--where` compares as the value's type: numbers (and true/false) by value, the rest as text."""
    if pd.api.types.is_number(actual):  # bools and the 0/1 of SQLite's booleans included
        text = wanted.lower()
        try:
            number = {"true": 1.0, "false": 0.0}[text] if text in ("true", "false") else float(text)
        except ValueError:
            return False
        return float(actual) == number
    return ("" if actual is None else str(actual)) == wanted
