"""What the command line prints: rich tables of runs, sweeps, one run, the analytic prediction.

Whatever a run stored is shown verbatim: no rich markup in cells ("[x]" stays "[x]"). Piped, stdout is
200 columns wide.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from tpbench.cli.arguments import one_line, usage
from tpbench.config import (
    ModelConfig,
    RunConfig,
    config_hash,
    dp_level_label,
    layout_label,
    mode_label,
    parallel_label,
    public_config,
    world_size,
)
from tpbench.models.shapes import model_name, shape_label

if TYPE_CHECKING:  # pandas and the database (sqlalchemy) are imported where a command needs them:
    import pandas as pd  # `tpbench plan` starts without them

    from tpbench.db import ResultsDB
    from tpbench.predict.steptime import TimePrediction
    from tpbench.predict.theory import Prediction
    from tpbench.predict.theory.depth import Limit
    from tpbench.run.sweep import Ran

out = Console(width=None if sys.stdout.isatty() else 200, markup=False, highlight=False)
err = Console(stderr=True, markup=False, highlight=False)

# The one figure `tpbench runs` shows per kind, and how.
HEADLINE: dict[str, tuple[str, Callable[[float], str]]] = {
    "validate": ("passed", lambda v: "passed" if v else "NOT passed"),
    "memory": ("peak_bytes", lambda v: f"{v / 2**20:,.1f} MiB peak"),
    "throughput": ("tokens_per_s", lambda v: f"{v:,.0f} tokens/s"),
}


def runs(frame: pd.DataFrame, metrics: pd.DataFrame, configs: dict[int, dict], url: str) -> None:
    """`tpbench runs`: one row per run, with its headline figure and the hardware it ran on (said once in
    the title where every run shares it). The ids and statuses stay whole at any width: the other
    columns wrap first, and where the table is still too wide, the run's kind, mode, ranks, shape and
    dtype share one column that wraps between words (`runs show ID` needs the id)."""
    hardware = frame["hardware"].dropna().unique() if len(frame) else []
    one_machine = len(hardware) == 1 and frame["hardware"].notna().all()
    title = f"{plural(len(frame), 'run')} in {url}" + (f", all on {hardware[0]}" if one_machine else "")
    rows = [_runs_row(row, metrics, configs) for row in frame.itertuples()]
    shown = {
        "sweep": any(r["sweep"] for r in rows),
        "hardware": not one_machine,
        "slurm job": frame["slurm_job_id"].notna().any(),  # then: each run's job and nodes (or host)
    }
    shown["nodes"] = shown["slurm job"]
    table = _runs_table(title, rows, shown, compact=False)
    if out.measure(table, options=out.options.update(max_width=10_000)).maximum > out.width:
        table = _runs_table(title, rows, shown, compact=True)
    out.print(table)


RUN_COLUMNS = ("kind", "mode", "tp×dp", "shape", "dtype")  # one "run" column where the table is narrow
WRAPPED_WIDTHS = {"result / error": 40, "sweep": 24, "hardware": 44, "slurm job": 12, "nodes": 24}


def _runs_row(row, metrics: pd.DataFrame, configs: dict[int, dict]) -> dict[str, str]:
    parallel = configs.get(row.id, {}).get("parallel", {})
    level = dp_level_label(parallel.get("dp_shard", "none"), parallel.get("dp_replicate", 1))
    return {
        "id": str(row.id),
        "started (UTC)": row.started_at.strftime("%m-%d %H:%M"),
        "kind": row.kind,
        "mode": row.mode,
        "tp×dp": f"{row.tp}×{row.dp}" + (f" {level}" if level else ""),
        "shape": f"L{row.layers} H{row.hidden} S{row.seq}",
        "dtype": row.dtype,
        "status": row.status,
        "result / error": _headline(row, metrics),
        "sweep": row.sweep or "",
        "hardware": row.hardware or "",
        "slurm job": row.slurm_job_id or "",
        "nodes": row.nodes or row.host or "",
    }


def _runs_table(title: str, rows: list[dict[str, str]], shown: dict[str, bool], compact: bool) -> Table:
    table = Table(title=title)
    widest = {key: max([len(key), *(len(r[key]) for r in rows)]) for key in ("id", "status")}
    table.add_column("id", justify="right", no_wrap=True, min_width=widest["id"])
    table.add_column("started (UTC)", overflow="fold")
    for column in ("run",) if compact else RUN_COLUMNS:
        table.add_column(column, overflow="fold")
    table.add_column("status", no_wrap=True, min_width=widest["status"])
    optional = [column for column in WRAPPED_WIDTHS if shown.get(column, True)]
    for column in optional:
        table.add_column(column, overflow="fold", max_width=WRAPPED_WIDTHS[column])
    for r in rows:
        run = [" ".join(r[c] for c in RUN_COLUMNS)] if compact else [r[c] for c in RUN_COLUMNS]
        table.add_row(r["id"], r["started (UTC)"], *run, r["status"], *(r[c] for c in optional))
    return table


def plural(count: int, noun: str) -> str:
    """1 run, 2 runs, 0 runs."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def run(db: ResultsDB, run_id: int, as_json: bool, full: bool = False) -> None:
    """One run: its text, with `full` (`runs show`) every field and, for a run not OK, a line on stderr
    with its error and where its logs are kept; its metrics. Or one JSON object."""
    try:
        record = db.run_record(run_id)
    except KeyError:
        usage(f"run {run_id}: no such run in {db.url}")
    _batches_as_run(record)
    if as_json:
        print(json.dumps(record, default=str))
        return
    text = db.text(run_id)
    if text:
        out.print(text, highlight=False, markup=False)
    if full:
        fields = Table(title=f"run {run_id}: {_stored_label(record)}", show_header=False)
        for key, value in record.items():
            if key not in ("config", "metrics"):
                fields.add_row(key, str(value))
        model = _model_of(record["config"])
        if model is not None:
            fields.add_row("model", f"{model_name(model)} {shape_label(model)}")
        out.print(fields)
    if full and record["status"] != "OK":  # `run` and `sweep` said it as the run ended
        logs = f"; its logs: {record['log_dir']}" if record["log_dir"] else ""
        one_line(f"run {run_id} {record['status']}: {record['error']}{logs}")
    if not record["metrics"]:  # a failed run: its one line on stderr says it all
        return
    title = f"run {run_id} {record['status']}: {_stored_label(record)}"
    metrics = Table(title=title, min_width=len(title))  # the title on one line
    metrics.add_column("metric")
    metrics.add_column("value", justify="right")
    for name, value in sorted(record["metrics"].items()):
        metrics.add_row(name, f"{value:.6g}")
    out.print(metrics)


def _stored_label(record: dict) -> str:
    """A stored run as run_label names a config: `memory tp tp=2 dp=2 ZeRO-2 layers=2`."""
    config = json.loads(record["config"]) if isinstance(record["config"], str) else record["config"]
    parallel = (config or {}).get("parallel", {})
    level = parallel.get("dp_shard", "none"), parallel.get("dp_replicate", 1)
    layout = layout_label(record["tp"], record["dp"], *level)
    return f"{record['kind']} {record['mode']} {layout} layers={record['layers']}"


def _batches_as_run(record: dict) -> None:
    """The batch sizes the run trained with: the database keeps both settings as given, though the
    batch policy reads one (fixed_per_rank: micro_batch per DP rank; fixed_global: global_batch split
    over them), so a fixed_per_rank run of 2 sequences at DP 1 once showed the unused global_batch 4."""
    if record["batch_policy"] == "fixed_per_rank":
        record["global_batch"] = record["micro_batch"] * record["dp"]
    else:
        record["micro_batch"] = record["global_batch"] // record["dp"]


def sweep(ran: list[Ran], dbs: dict[str, ResultsDB], as_json: bool) -> None:
    """The configs of a sweep, each with its run and status, and the settings that vary among them."""
    if as_json:
        for r in ran:
            if r.run_id is not None:
                record = dbs[r.cfg.db.url].run_record(r.run_id)
                _batches_as_run(record)  # as `runs show --json` gives it
                print(json.dumps(record, default=str))
        return
    import pandas as pd

    flat = pd.json_normalize([public_config(r.cfg) for r in ran])
    varying = [key for key in flat.columns if key != "sweep" and flat[key].astype(str).nunique() > 1]
    table = Table(title=f"sweep {ran[0].cfg.sweep}" if ran else "sweep: nothing to run")
    for column in ("run", "status", "mode", *varying):
        table.add_column(column)
    for r, values in zip(ran, flat[varying].itertuples(index=False), strict=True):
        table.add_row(str(r.run_id), r.status, mode_label(r.cfg.parallel), *map(_value, values))
    out.print(table)


def _value(value: object) -> str:
    """A setting as an override spells it: true and false, not Python's True and False."""
    return str(value).lower() if str(value) in ("True", "False") else str(value)


def configs(configs: list[RunConfig]) -> None:
    """--cfg: the resolved config of every run, as YAML documents, each headed by its mode."""
    shown = (f"# mode={mode_label(c.parallel)}\n" + OmegaConf.to_yaml(public_config(c)) for c in configs)
    print("\n---\n".join(shown), end="")


def _model_of(config: object) -> ModelConfig | None:
    """The model of a stored run's config (a dict, or its JSON), its defaults filled; None if unreadable."""
    if isinstance(config, str):
        config = json.loads(config)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        return None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in config["model"].items() if k in known})


def plan(cfg: RunConfig, prediction: Prediction, flops: float) -> None:
    """`tpbench plan`: the predicted memory per rank at each moment of a step, the collectives, FLOPs."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    title = (
        f"{model_name(m)} {mode_label(p)} {parallel_label(p)} ({shape_label(m)}) "
        f"seq {t.seq_len} micro-batch {prediction.dims.B} {t.dtype} {t.precision}"
    )
    memory = Table(title=f"{title}: predicted memory per rank (MiB)")
    for column in ("moment", "params", "grads", "optimizer", "activations", "temporaries", "total"):
        memory.add_column(column, justify="left" if column == "moment" else "right")
    for moment in prediction.moments:
        peak = moment is prediction.peak
        values = (moment.params, moment.grads, moment.optimizer, moment.activations, moment.temporaries)
        cells = [f"{v / 2**20:,.1f}" for v in (*values, moment.total)]
        memory.add_row(moment.name + (" (peak)" if peak else ""), *cells, style="bold" if peak else None)
    out.print(memory)
    comm = Table(title=f"{title}: predicted collectives per rank and step")
    for column in ("op", "purpose", "count", "MiB"):
        comm.add_column(column, justify="left" if column in ("op", "purpose") else "right")
    for r in prediction.comm_rows():
        comm.add_row(r.op, r.purpose, str(r.count), f"{r.bytes / 2**20:,.2f}")
    comm.add_row("total", "", "", f"{prediction.comm_bytes_per_step / 2**20:,.2f}", style="bold")
    out.print(comm)
    out.print(f"model FLOPs per step (global batch): {flops:.4g}")
    if cfg.launch.device == "cuda":
        from tpbench.predict.theory import reserved

        gpu = cfg.launch.emulate_gpu
        r = reserved.reserved(cfg, prediction, gpu)
        pools = (
            f", FSDP2's all-gather and reduce-scatter streams' pools {r.all_gather / 2**20:,.1f} + "
            f"{r.reduce_scatter / 2**20:,.1f}"
            if r.all_gather or r.reduce_scatter
            else ""
        )
        out.print(
            f"predicted max_memory_allocated on an {gpu} (the peak and 2 cuBLAS workspaces): "
            f"{prediction.max_memory_allocated_bytes(gpu) / 2**20:,.1f} MiB; max_memory_reserved "
            f"(those{pools}; not the allocator's fragmentation, --measure replays it): "
            f"{r.total / 2**20:,.1f} MiB"
        )


def depth(cfg: RunConfig) -> None:
    """`tpbench plan`: each mode's predicted peak as F + L (a/T + r) (tpbench.predict.theory.depth), and its
    ratio to DDP's as L grows, in the config's world; the modes compose refuses, each with its line."""
    limits, refused = _depth_limits(cfg)
    T = max(lim.split.T for lim in limits)
    table = Table(
        title=f"depth: peak = F + L (a/T + r) per rank, T {T}, {world_size(cfg)} ranks (MiB; a, r per layer)"
    )
    columns = ("mode", "peak moment", "F", "a", "r", "a/T + r", f"peak at L{cfg.model.num_hidden_layers}")
    for column in (*columns, "limit vs DDP", "(a/T+r)/(a+r)"):
        table.add_column(column, justify="left" if column in columns[:2] else "right")
    later = []
    for lim in limits:
        s = lim.split
        mib = [f"{v / 2**20:,.2f}" for v in (s.F, s.a, s.r, s.per_layer, s.peak(s.layers))]
        bold = "bold" if lim.mode == mode_label(cfg.parallel) else None
        table.add_row(lim.mode, s.moment, *mib, f"{lim.vs_ddp:.2%}", f"{s.own_limit:.2%}", style=bold)
        if s.steepest.moment != s.moment:
            later.append(f"{lim.mode}: from L{s.steepest_from} on, the peak is at {s.steepest.moment}")
    out.print(table)
    notes = [
        "a: per layer, what TP divides by T, counted whole (attention and MLP weights, their gradients "
        "and AdamW state, the activations inside the TP regions); r: what every rank keeps whole (norm "
        "weights, the gathered region inputs, the stream's norm tensors, which SP shards into a); F: what "
        "does not grow with L (embedding, LM head, logits: VP shards them, so its a, r and limit are TP's)",
        "limit vs DDP: the peaks' ratio as L grows, a/T + r over DDP's a + r (DDP's counts its gradient "
        "buckets too); (a/T+r)/(a+r): over the same mode unsharded, the seed's form",
        *later,
        *(f"{mode}: refused ({why})" for mode, why in refused.items()),
    ]
    for note in notes:
        out.print(note)


def _depth_limits(cfg: RunConfig) -> tuple[list[Limit], dict[str, str]]:
    """The config's depth split in each mode of the seed's comparison, and the modes compose refuses
    for it (a KV head count T does not divide under the dtensor engine, ...), each with its line."""
    from tpbench.config import ConfigError
    from tpbench.predict.theory import depth
    from tpbench.run.compose import check

    configs, refused = {}, {}
    for mode, c in depth.mode_configs(cfg).items():
        try:
            check(c)
            configs[mode] = c
        except ConfigError as e:
            refused[mode] = str(e)
    return depth.limits(configs), refused


def step_time(cfg: RunConfig, timed: TimePrediction) -> None:
    """`tpbench plan`'s time lines: the time model's step, its split, tokens/s and MFU."""
    where = f"an {cfg.launch.emulate_gpu}" if cfg.launch.device == "cuda" else "this CPU"
    comm = ", ".join(f"{purpose} {ms(s)}" for purpose, s in sorted(timed.comm_exposed.items()))
    out.print(
        f"predicted step time on {where}: {ms(timed.step_s)} ms = compute {ms(timed.compute_s)}"
        f" + exposed communication {ms(timed.comm_s)} ({comm or 'none'}) + optimizer "
        f"{ms(timed.optimizer_s)}; {timed.tokens_per_s:,.0f} tokens/s"
    )
    if timed.host_s:
        bound = "host-bound: the GPU waits for it" if timed.host_bound else "under the device's"
        out.print(
            f"predicted host issue time: {ms(timed.host_s)} ms ({bound}; "
            f"{ms(timed.device_s)} ms on the device)"
        )
    if timed.mfu is not None:
        out.print(
            f"predicted MFU: {100 * timed.mfu:.1f}% (model FLOPs / (step time x devices x peak FLOP/s))"
        )


def ms(seconds: float) -> str:
    """Milliseconds in one format, whatever their size: whole from 100 up, else 3 significant digits;
    never an exponent (16,750; 2,144; 36.8; 0.483)."""
    value = seconds * 1e3
    if value == 0 or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:,.{2 - math.floor(math.log10(abs(value)))}f}"


def plan_dict(
    cfg: RunConfig, prediction: Prediction, flops: float, measured: tuple[dict, float] | None = None
) -> dict:
    """`tpbench plan --json`: the prediction's fields of one config, in bytes per rank (what `plan`
    prints as tables); with --measure, the emulated busiest rank's figures under "measured"."""
    from tpbench.predict.theory import sharding

    p, m, t = cfg.parallel, cfg.model, cfg.train
    moments = [
        {"name": x.name, **{f: getattr(x, f) for f in MOMENT_FIELDS}, "total": x.total}
        for x in prediction.moments
    ]
    out = {
        "config_hash": config_hash(cfg),
        "kind": cfg.kind,
        "mode": mode_label(p),
        "engine": p.engine,
        "tp": p.tp,
        "dp": p.dp,
        "dp_shard": p.dp_shard,
        "dp_replicate": p.dp_replicate,
        "sp": p.sp,
        "vp": p.vp,
        "model": m.name,
        "layers": m.num_hidden_layers,
        "hidden": m.hidden_size,
        "seq": t.seq_len,
        "micro_batch": prediction.dims.B,
        "dtype": t.dtype,
        "precision": t.precision,
        "recompute": t.recompute,
        "peak_bytes": prediction.peak_bytes,
        "peak_moment": prediction.peak.name,
        "split": sharding.split(prediction.dims, sharding.sharding(cfg), prediction.peak),
        "moments": moments,
        "comm": [dataclasses.asdict(r) for r in prediction.comm_rows()],
        "comm_bytes_per_step": prediction.comm_bytes_per_step,
        "model_flops_per_step": flops,
    }
    if cfg.launch.device == "cuda":
        gpu = cfg.launch.emulate_gpu
        from tpbench.predict.theory import reserved

        out |= {
            "gpu": gpu,
            "max_memory_allocated_bytes": prediction.max_memory_allocated_bytes(gpu),
            "max_memory_reserved_bytes": reserved.reserved(cfg, prediction, gpu).total,
        }
    if measured is not None:
        from tpbench.parallel.emulation import emulated_rank

        result, seconds = measured
        out["measured"] = {"rank": emulated_rank(cfg), "seconds": seconds, **result}
    return out


MOMENT_FIELDS = ("params", "grads", "optimizer", "activations", "temporaries")


def measured(
    cfg: RunConfig, prediction: Prediction, result: dict[str, float], seconds: float, rank: int
) -> None:
    """`tpbench plan --measure`: the fake-tensor emulation of the config's busiest rank beside the
    prediction."""
    peak, predicted = result["peak_bytes"], prediction.peak_bytes
    out.print(
        f"emulated rank {rank} (fake tensors, {seconds:.1f} s): live-tensor peak "
        f"{peak / 2**20:,.1f} MiB, predicted {predicted / 2**20:,.1f} ({(predicted - peak) / peak:+.2%})"
    )
    if "modelled_max_memory_allocated_bytes" in result:
        allocated = result["modelled_max_memory_allocated_bytes"]
        predicted = prediction.max_memory_allocated_bytes(cfg.launch.emulate_gpu)
        out.print(
            f"caching allocator model ({cfg.launch.emulate_gpu}, with cuBLAS workspaces): max allocated "
            f"{allocated / 2**20:,.1f} MiB, predicted {predicted / 2**20:,.1f} "
            f"({(predicted - allocated) / allocated:+.2%}); max reserved "
            f"{result['modelled_max_memory_reserved_bytes'] / 2**20:,.1f} MiB (expandable segments "
            f"{result['modelled_max_memory_reserved_expandable_bytes'] / 2**20:,.1f}), predicted "
            f"{result['predicted_max_memory_reserved_bytes'] / 2**20:,.1f}"
        )


def _headline(row, metrics: pd.DataFrame) -> str:
    import pandas as pd

    if row.status != "OK":
        return row.error.splitlines()[0][:80] if row.error else ""
    name, fmt = HEADLINE[row.kind]
    if row.id not in metrics.index or name not in metrics.columns or pd.isna(metrics.at[row.id, name]):
        return ""
    return fmt(metrics.at[row.id, name])
