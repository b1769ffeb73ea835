"""The tpbench command line: one command per verb.

`run` and `sweep` compose configs from conf/ with Hydra overrides, launch torchrun jobs and record them;
`runs` lists and shows what the database holds. Bad input is one line on stderr and exit code 2, with
nothing launched and nothing written; a failed run exits 1, an interrupted one 130.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column, Table
from typer._click.core import Command  # typer 0.29 vendors click (not installed by itself)
from typer._click.exceptions import (
    BadOptionUsage,
    BadParameter,
    NoArgsIsHelpError,
    NoSuchOption,
    UsageError,
)
from typer.core import TyperCommand, TyperGroup, TyperOption

from tpbench.config import (
    DbConfig,
    RunConfig,
    config_hash,
    hide_password,
    mode_label,
    public_config,
    run_label,
)

if TYPE_CHECKING:  # pandas and the database (sqlalchemy) are imported where a command needs them:
    import pandas as pd  # `tpbench plan` starts without them

    from tpbench.db import ResultsDB
    from tpbench.theory import Prediction


class _OneLineUsage:
    """typer's own usage errors (an unknown command or option, a missing or malformed value, an extra
    argument) as one line naming the bad input and what is accepted, exit code 2, like tpbench's
    checks of the config, instead of a box of several lines. They are raised while a command parses
    its arguments, before anything runs. `tpbench` alone still prints the help."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        with _in_one_line(ctx):
            return super().parse_args(ctx, args)  # type: ignore[misc]


class OneLineGroup(_OneLineUsage, TyperGroup):
    def resolve_command(
        self, ctx: typer.Context, args: list[str]
    ) -> tuple[str | None, Command | None, list[str]]:
        with _in_one_line(ctx):  # an unknown command
            return super().resolve_command(ctx, args)


class OneLineCommand(_OneLineUsage, TyperCommand):
    pass


@contextmanager
def _in_one_line(ctx: typer.Context) -> Iterator[None]:
    try:
        yield
    except NoArgsIsHelpError:
        raise
    except UsageError as e:
        _usage(_usage_error_line(e, ctx))


def _usage_error_line(e: UsageError, ctx: typer.Context) -> str:
    """`tpbench report: Option '--format' requires an argument; accepted for --format: html, md, ...`."""
    command = ctx.command
    said = (e.message if isinstance(e, NoSuchOption) else e.format_message()).rstrip(".")  # no guesses
    params = command.get_params(ctx)
    param = e.param if isinstance(e, BadParameter) else None
    if isinstance(e, BadOptionUsage):
        param = next((p for p in params if e.option_name in p.opts), None)
    if isinstance(e, NoSuchOption):
        names = [name for p in params if isinstance(p, TyperOption) for name in p.opts]
        accepted = "accepted options are " + ", ".join(names)
    elif isinstance(param, TyperOption) and param.is_flag:
        accepted = f"{param.opts[0]} is a flag: given alone, it takes no value"
    elif param is not None:
        accepted = f"accepted for {param.opts[0]}: {getattr(param, 'help', None) or param.type.name}"
    elif isinstance(command, TyperGroup):
        accepted = "accepted commands are " + ", ".join(command.list_commands(ctx))
    else:
        accepted = "usage: " + ctx.get_usage().removeprefix("Usage: ")
    return f"{ctx.command_path}: {said}; {accepted}"


app = typer.Typer(
    cls=OneLineGroup,
    help="Tensor, sequence and vocab parallelism on MiniMind: run, sweep and list experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
runs_app = typer.Typer(
    cls=OneLineGroup, help="List the runs of the database, or show one.", add_completion=False
)
app.add_typer(runs_app, name="runs")

# Whatever a run stored is shown verbatim: no rich markup in cells ("[x]" stays "[x]").
out = Console(width=None if sys.stdout.isatty() else 200, markup=False, highlight=False)  # piped: 200 columns
err = Console(stderr=True, markup=False, highlight=False)

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
# The one figure `tpbench runs` shows per kind, and how.
HEADLINE: dict[str, tuple[str, Callable[[float], str]]] = {
    "validate": ("passed", lambda v: "passed" if v else "NOT passed"),
    "memory": ("peak_bytes", lambda v: f"{v / 2**20:,.1f} MiB peak"),
    "throughput": ("tokens_per_s", lambda v: f"{v:,.0f} tokens/s"),
}

Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="Hydra overrides: short names (tp dp sp vp layers hidden heads kv_heads vocab seq micro_batch "
        "global_batch steps dtype precision), groups (model mode batch kind device db launcher, "
        "+preset, +fault) or any key of --cfg.",
        show_default=False,
    ),
]
Device = Annotated[
    str | None,
    typer.Option(help="Runs whose hardware holds this text, any case: a GPU or CPU model, e.g. H100."),
]
ShowCfg = Annotated[bool, typer.Option("--cfg", help="Print the resolved config of every run, then exit.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print each run as one JSON object on stdout.")]


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench run  (the tiny MiniMind, tp=2, validate, memory and throughput)\n\n"
    "tpbench run tp=2 sp=true vp=true layers=64\n\n"
    "tpbench run mode=tp_sp_vp model=minimind kind=memory batch=fixed_global dtype=bfloat16\n\n"
    "tpbench run kind=validate +fault=kill_on_rank1 --json",
)
def run(overrides: Overrides = None, cfg: ShowCfg = False, as_json: AsJson = False) -> None:
    """Run one config (one run per kind; kind=all, the default, is all three) and record it."""
    configs = _compose(overrides or [], single=True)
    if cfg:
        _print_configs(configs)
        return
    on_slurm = _on_slurm_launcher(configs)
    dbs = _databases(configs)
    if on_slurm:
        _on_slurm(configs, dbs, force=True, wait_only=False, as_json=as_json, sweep=False)
    failed = interrupted = False
    for c in configs:
        label = run_label(c)
        with err.status(f"{label}: starting") as status:
            run_id, outcome_status = _run_one(
                c, dbs, lambda line, s=status, lb=label: s.update(escape(f"{lb}: {line}"))
            )
        failed |= outcome_status != "OK"
        if run_id is not None:
            _report_run(dbs[c.db.url], run_id, as_json)
        if outcome_status == "INTERRUPTED":
            interrupted = True
            break
    raise typer.Exit(EXIT_INTERRUPTED if interrupted else EXIT_FAILED if failed else 0)


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench sweep layers=8,16,32,64 mode=ddp,tp,tp_sp,tp_vp,tp_sp_vp kind=memory\n\n"
    "tpbench sweep +preset=seed_tp_memory\n\n"
    "tpbench sweep +preset=seed_check --force",
)
def sweep(
    overrides: Overrides = None,
    force: Annotated[bool, typer.Option(help="Run configs that already have an OK run too.")] = False,
    name: Annotated[
        str | None,
        typer.Option(
            help="Sweep name stored with each run [default: the preset's name, else the overrides]."
        ),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="launcher=slurm: submit nothing; follow the jobs this sweep submitted before to their end.",
        ),
    ] = False,
    cfg: ShowCfg = False,
    as_json: AsJson = False,
) -> None:
    """Run the cartesian product of comma-separated overrides (and of a preset's sweep), skipping
    configs that already have an OK run; a failed run does not stop the sweep. With launcher=slurm every
    run is a Slurm job (one job array) and the command follows them."""
    configs = _compose(overrides or [], single=False)
    for c in configs:
        c.sweep = c.sweep or name or " ".join(map(_shown, overrides or [])) or "default"
    if cfg:
        _print_configs(configs)
        return
    on_slurm = _on_slurm_launcher(configs)
    if wait and not on_slurm:
        _usage("--wait follows Slurm jobs: it needs launcher=slurm (a local sweep runs in this shell)")
    dbs = _databases(configs)
    if on_slurm:
        _on_slurm(configs, dbs, force=force, wait_only=wait, as_json=as_json, sweep=True)
    from tpbench import machine

    finished = {url: db.finished() for url, db in dbs.items()}
    todo, done = [], []
    for c in configs:  # done: an OK run of the config on this node's hardware (tpbench.db)
        run_id = None if force else finished[c.db.url].get((config_hash(c), machine.here_key(c)))
        (todo.append(c) if run_id is None else done.append((run_id, c)))
    counts = {"OK": 0, "failed": 0}
    ran: list[tuple[int | None, RunConfig, str]] = [(run_id, c, "skipped") for run_id, c in done]
    interrupted = False
    with Progress(
        SpinnerColumn(),
        TextColumn(
            "{task.description}", table_column=Column(max_width=60, no_wrap=True, overflow="ellipsis")
        ),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(f"ok {{task.fields[ok]}} · failed {{task.fields[failed]}} · skipped {len(done)}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
    ) as progress:
        task = progress.add_task("sweep", total=len(todo), ok=0, failed=0)
        for c in todo:
            label = run_label(c)
            progress.update(task, description=label)
            run_id, status = _run_one(
                c, dbs, lambda line, lb=label: progress.update(task, description=escape(f"{lb}: {line}"))
            )
            counts["OK" if status == "OK" else "failed"] += 1
            progress.update(task, advance=1, ok=counts["OK"], failed=counts["failed"], description="sweep")
            ran.append((run_id, c, status))
            if status == "INTERRUPTED":
                interrupted = True
                break
    _print_sweep(ran, dbs, as_json)
    raise typer.Exit(EXIT_INTERRUPTED if interrupted else EXIT_FAILED if counts["failed"] else 0)


@runs_app.callback(
    invoke_without_command=True,
    epilog="Examples:\n\n"
    "tpbench runs\n\n"
    "tpbench runs --status FAILED --since 2h\n\n"
    "tpbench runs --kind memory --sweep seed_tp_memory\n\n"
    "tpbench runs --device H100\n\n"
    "tpbench runs show 12 --json",
)
def runs(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option(help="OK, FAILED, OOM, TIMEOUT or INTERRUPTED.")] = None,
    kind: Annotated[str | None, typer.Option(help="validate, memory or throughput.")] = None,
    mode: Annotated[str | None, typer.Option(help="ddp, tp, tp_sp, tp_vp, tp_sp_vp, ...")] = None,
    since: Annotated[str | None, typer.Option(help="An ISO date/time (UTC) or an age: 30m, 12h, 7d.")] = None,
    sweep: Annotated[str | None, typer.Option(help="The sweep name.")] = None,
    device: Device = None,
    db: Annotated[str, typer.Option(help="SQLAlchemy URL of the database.")] = DbConfig.url,
) -> None:
    """List the runs, oldest first, with the headline figure of each and the hardware it ran on."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = db
        return
    import pandas as pd

    from tpbench.db import parse_since

    _check_filters(status=status, kind=kind, mode=mode)
    try:
        start = parse_since(since) if since else None
    except ValueError:
        _usage(f"--since={since}: accepted are an ISO date or time such as 2026-11-30T08:00, or 30m, 12h, 7d")
    results = _read_db(db)
    if device is not None and results.runs(device=device).empty:
        _no_such_device(results, device)
    frame = results.runs(status=status, kind=kind, mode=mode, since=start, sweep=sweep, device=device)
    metrics = results.metrics(frame["id"].tolist()) if len(frame) else pd.DataFrame()
    table = Table(title=f"{len(frame)} runs in {results.url}")
    for column in ("id", "started (UTC)", "kind", "mode", "tp×dp", "shape", "dtype", "status"):
        table.add_column(column, justify="right" if column == "id" else "left", no_wrap=True)
    table.add_column("result / error", overflow="ellipsis", no_wrap=True, max_width=40)
    table.add_column("sweep", overflow="ellipsis", no_wrap=True, max_width=24)
    table.add_column("hardware", overflow="ellipsis", no_wrap=True, max_width=44)
    on_slurm = frame["slurm_job_id"].notna().any()  # then: each run's job and nodes (or host)
    if on_slurm:
        table.add_column("slurm job", no_wrap=True)
        table.add_column("nodes", overflow="ellipsis", no_wrap=True, max_width=24)
    for row in frame.itertuples():
        where = [row.slurm_job_id or "", row.nodes or row.host] if on_slurm else []
        table.add_row(
            str(row.id),
            row.started_at.strftime("%m-%d %H:%M"),
            row.kind,
            row.mode,
            f"{row.tp}×{row.dp}",
            f"L{row.layers} H{row.hidden} S{row.seq}",
            row.dtype,
            row.status,
            _headline(row, metrics),
            row.sweep,
            row.hardware,
            *where,
        )
    out.print(table)


@runs_app.command(
    "show", cls=OneLineCommand, epilog="Examples:\n\ntpbench runs show 12\n\ntpbench runs show 12 --json"
)
def show(
    ctx: typer.Context,
    run_id: Annotated[str, typer.Argument(help="The run id, a number as `tpbench runs` lists it.")],
    as_json: AsJson = False,
    db: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the database.")] = None,
) -> None:
    """Show one run: status, environment, every headline metric; --json adds the resolved config."""
    if not run_id.isdecimal():  # read here, not by typer, so that the message names the value
        _usage(f"run id {run_id}: accepted is a number, a run's id as `tpbench runs` lists it")
    _report_run(_read_db(db or ctx.obj), int(run_id), as_json, full=True)


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench report  (every run, into runs/report.html)\n\n"
    "tpbench report --kind memory --sweep seed_tp_memory --out memory.html\n\n"
    "tpbench report --format md --since 12h --where layers=8 --where model.name=tiny\n\n"
    "tpbench report --device H100 --out h100.html\n\n"
    "tpbench report --format csv --out runs.csv",
)
def report(
    fmt: Annotated[str, typer.Option("--format", help="html, md, csv or json.")] = "html",
    out_path: Annotated[
        str | None, typer.Option("--out", help="File to write (default: runs/report.FORMAT).")
    ] = None,
    db: Annotated[str, typer.Option(help="SQLAlchemy URL of the database.")] = DbConfig.url,
    sweep: Annotated[str | None, typer.Option(help="The sweep name.")] = None,
    kind: Annotated[str | None, typer.Option(help="validate, memory or throughput.")] = None,
    mode: Annotated[str | None, typer.Option(help="ddp, tp, tp_sp, tp_vp, tp_sp_vp, ...")] = None,
    since: Annotated[str | None, typer.Option(help="An ISO date/time (UTC) or an age: 30m, 12h, 7d.")] = None,
    device: Device = None,
    where: Annotated[
        list[str] | None,
        typer.Option(help="key=value on a run column (layers, dtype, ...) or a config key (model.name)."),
    ] = None,
) -> None:
    """Write DDP vs TP vs SP vs VP as tables and charts: html (one self-contained file), md (charts as PNG
    files beside it), csv or json (the raw rows). An empty selection writes nothing and exits 0."""
    from tpbench import report as reporting  # matplotlib loads only for this command

    if fmt not in reporting.FORMATS:
        _usage(f"--format {fmt}: accepted are {', '.join(reporting.FORMATS)}")
    _check_filters(kind=kind, mode=mode)
    try:
        selection = reporting.Selection.parse(sweep, kind, mode, since, where, device)
        results = _read_db(db)
        if device is not None and results.runs(device=device).empty:
            _no_such_device(results, device)
        path = reporting.write(results, selection, fmt, out_path)
    except reporting.SelectionError as e:
        _usage(str(e))
    except reporting.NothingToReport as e:
        _one_line(str(e))
        return
    out.print(str(path), highlight=False)


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench plan tp=8 sp=true vp=true model=minimind layers=64\n\n"
    "tpbench plan +preset=seed_tp_memory  (every config of the sweep)\n\n"
    "tpbench plan mode=ddp,tp_sp_vp model=seed_memory precision=mixed",
)
def plan(
    overrides: Overrides = None,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Also emulate the busiest rank with fake tensors (no compute, any size) and print its "
            "measured peak beside the prediction; with launch.device=cuda, the allocator's too.",
        ),
    ] = False,
) -> None:
    """Print the analytic model's prediction, per rank, without running anything: memory at each moment
    of a training step (the peak marked), collective bytes per step, model FLOPs per step."""
    from tpbench import theory

    configs = _compose([*(overrides or []), *(["launch.emulate=fake"] if measure else [])], single=False)
    for c in (c for c in configs if c.kind == configs[0].kind):  # kind=all: one config per kind
        prediction = theory.predict(c)
        p, m, t = c.parallel, c.model, c.train
        title = (
            f"{mode_label(p)} tp={p.tp} dp={p.dp} L{m.num_hidden_layers} H{m.hidden_size} S{t.seq_len} "
            f"B{prediction.dims.B} {t.dtype} {t.precision}"
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
        out.print(f"model FLOPs per step (global batch): {theory.model_flops_per_step(c):.4g}")
        if c.launch.device == "cuda":
            gpu = c.launch.emulate_gpu
            out.print(
                f"predicted max_memory_allocated on an {gpu} (the peak and 2 cuBLAS workspaces): "
                f"{prediction.max_memory_allocated_bytes(gpu) / 2**20:,.1f} MiB"
            )
        if measure:
            _print_measured(c, prediction)


def _emulate(cfg: RunConfig) -> tuple[dict[str, float], float]:
    """The memory experiment of the config's busiest rank on fake tensors, in this process: its
    measurements by name, and the seconds it took."""
    import dataclasses
    import gc
    import time

    from tpbench import emulation

    # the peak of a step repeats from the second step on: one warm-up step, one measured
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, warmup=1, steps=1))
    gc.freeze()  # the imports' objects, out of the way of memory.run's gc.collect (0.3 s -> ms)
    start = time.perf_counter()
    result = {m.name: m.value for m in emulation.measure_in_process(cfg).measurements}
    return result, time.perf_counter() - start


def _print_measured(cfg: RunConfig, prediction: Prediction) -> None:
    """The fake-tensor emulation of the config's busiest rank, beside the prediction."""
    from tpbench import emulation

    result, seconds = _emulate(cfg)
    peak, predicted = result["peak_bytes"], prediction.peak_bytes
    out.print(
        f"emulated rank {emulation.emulated_rank(cfg)} (fake tensors, {seconds:.1f} s): live-tensor peak "
        f"{peak / 2**20:,.1f} MiB, predicted {predicted / 2**20:,.1f} ({(predicted - peak) / peak:+.2%})"
    )
    if "modelled_max_memory_allocated_bytes" in result:
        allocated = result["modelled_max_memory_allocated_bytes"]
        predicted = prediction.max_memory_allocated_bytes(cfg.launch.emulate_gpu)
        out.print(
            f"caching allocator model ({cfg.launch.emulate_gpu}, with cuBLAS workspaces): max allocated "
            f"{allocated / 2**20:,.1f} MiB, predicted {predicted / 2**20:,.1f} "
            f"({(predicted - allocated) / allocated:+.2%}); max reserved "
            f"{result['modelled_max_memory_reserved_bytes'] / 2**20:,.1f} MiB"
        )


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench fit model=llama3_70b seq=8192 gpu=H100-80GB gpus_per_node=8\n\n"
    "tpbench fit model=qwen3_8b seq=4096 gpu=H200 global_batch=64 --json\n\n"
    "tpbench fit model.hf_config=path/to/config.json seq=2048 gpu=A100-80GB tp=8 --measure",
)
def fit(
    overrides: Overrides = None,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Confirm the best rows (--top) by emulating their busiest rank with fake tensors: the "
            "live-tensor peak and the caching allocator model's reserved memory.",
        ),
    ] = False,
    top: Annotated[int, typer.Option(help="How many of the best rows --measure emulates.", min=1)] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the search as one JSON object.")] = False,
    cuda_context_mib: Annotated[
        float, typer.Option(help="CUDA context per GPU, MiB (an assumption: see tpbench.fit).", min=0)
    ] = 512.0,
    nccl_mib: Annotated[
        float,
        typer.Option(help="NCCL buffers per communicator, MiB (an assumption: see tpbench.fit).", min=0),
    ] = 128.0,
    max_micro_batch: Annotated[
        int, typer.Option(help="The largest micro-batch searched (without global_batch).", min=1)
    ] = 256,
) -> None:
    """Rank every TP layout of a model on a GPU: each T dividing the GPUs per node (gpus_per_node=,
    default 8) and the heads, with SP, VP and recompute, at the largest micro-batch that fits; the
    analytic per-rank peak on that GPU (gpu=, from tpbench.hardware), its headroom, the bytes moved
    per step and recompute's extra FLOPs. Training defaults: bf16, pure precision, fused AdamW."""
    from tpbench import fit as fitting

    overheads = fitting.Overheads(int(cuda_context_mib * 2**20), int(nccl_mib * 2**20))
    try:
        request = fitting.parse(overrides or [])
    except fitting.FitError as e:
        _usage(str(e))
    (base,) = _compose(request.overrides, single=True)
    try:
        given, batch = request.given, request.global_batch
        result = fitting.search(
            base, request.gpu, request.gpus_per_node, given, batch, overheads, max_micro_batch
        )
    except fitting.FitError as e:
        _usage(str(e))
    if measure:
        for row in result.fitting[:top]:
            measured, seconds = _emulate(result.config(row))
            reserved = measured["modelled_max_memory_reserved_bytes"] + row.overhead_bytes
            row.measured = {
                "peak_bytes": measured["peak_bytes"],
                "max_memory_allocated_bytes": measured["modelled_max_memory_allocated_bytes"],
                "max_memory_reserved_bytes": measured["modelled_max_memory_reserved_bytes"],
                "reserved_peak_bytes": reserved,
                "fits": reserved <= request.gpu.memory_bytes,
                "seconds": seconds,
            }
    if as_json:
        print(json.dumps(result.as_dict()))
        return
    for table in fitting.tables(result):
        out.print(table)
    if request.gpu.note:
        out.print(f"{request.gpu.name}: {request.gpu.note}")


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench diagram tp=4 sp=true  (runs/diagram.svg)\n\n"
    "tpbench diagram tp=4 kv_heads=2 --compare  (TP and TP+SP side by side)\n\n"
    "tpbench diagram tp=4 sp=true vp=true --format png --out block.png",
)
def diagram(
    overrides: Overrides = None,
    fmt: Annotated[str, typer.Option("--format", help="svg or png.")] = "svg",
    out_path: Annotated[
        str | None, typer.Option("--out", help="File to write (default: runs/diagram.FORMAT).")
    ] = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Draw the same config without and with SP, side by side.")
    ] = False,
) -> None:
    """Draw one transformer block at TP = T from a traced training step (every rank emulated in this
    process on torch's fake process group): each module, each rank's weight shard (math view W [in, out]
    and nn.Linear view [out, in]), each activation's per-rank shape, and every collective, forward and
    backward, with its type, group and bytes. One layer is traced, whatever model.num_hidden_layers says."""
    from pathlib import Path

    from tpbench import diagram as diagrams  # torch and graphviz load only for this command

    if fmt not in diagrams.FORMATS:
        _usage(f"--format {fmt}: accepted are {', '.join(diagrams.FORMATS)}")
    path = Path(out_path) if out_path is not None else diagrams.default_path(fmt)
    try:
        configs = diagrams.configs(overrides or [], compare)
        diagrams.check_writable(path)
    except diagrams.ConfigError as e:
        _usage(str(e))
    drawn = diagrams.render([diagrams.trace(c) for c in configs], fmt)
    path.write_bytes(drawn)
    out.print(str(path), highlight=False)


# -- helpers -----------------------------------------------------------------------------------------


def _compose(overrides: list[str], single: bool) -> list[RunConfig]:
    from tpbench import compose  # torch loads only for the commands that launch
    from tpbench.parallel.checks import ConfigError

    try:
        return compose.expand(overrides, single=single)
    except ConfigError as e:
        _usage(str(e))


def _check_filters(**given: str | None) -> None:
    """--status, --kind, --mode: a value no run can have is a typo, refused rather than matching nothing."""
    from tpbench.config import CONF_DIR
    from tpbench.experiments import KINDS
    from tpbench.results import Status

    accepted = {
        "status": tuple(Status),
        "kind": KINDS,
        "mode": tuple(sorted(p.stem for p in (CONF_DIR / "mode").glob("*.yaml"))),
    }
    for flag, value in given.items():
        if value is not None and value not in accepted[flag]:
            _usage(f"--{flag} {value}: accepted are {', '.join(accepted[flag])}")


def _databases(configs: list[RunConfig]) -> dict[str, ResultsDB]:
    from tpbench.db import DatabaseRefused, ResultsDB

    try:
        return {url: ResultsDB(url) for url in dict.fromkeys(c.db.url for c in configs)}
    except DatabaseRefused as e:
        _usage(str(e))


def _read_db(url: str) -> ResultsDB:
    from tpbench.db import DatabaseRefused, NoDatabase, ResultsDB

    try:
        return ResultsDB(url, create=False)
    except NoDatabase as e:
        err.print(str(e))
        raise typer.Exit(0) from None
    except DatabaseRefused as e:
        _usage(str(e))


def _no_such_device(db: ResultsDB, device: str) -> NoReturn:
    """--device that no run's hardware holds: one line naming what the database has, exit 0 as for an
    empty selection."""
    kinds = "; ".join(db.hardware_kinds()) or "none: it has no runs"
    _one_line(f"--device {device}: no run in {db.url} ran on such hardware; its hardware: {kinds}")
    raise typer.Exit(0)


def _run_one(
    cfg: RunConfig, dbs: dict[str, ResultsDB], on_progress: Callable[[str], None]
) -> tuple[int | None, str]:
    """Launch one config and record it; returns (run id, status). The id is None on a node other than
    the one of rank 0 in a multi-node job, which leaves recording to that node."""
    from sqlalchemy.exc import SQLAlchemyError

    from tpbench.launch import run_job

    try:
        outcome = run_job(cfg, on_progress)
    except KeyboardInterrupt:  # before the agent started or after the job ended: nothing ran to record
        return None, "INTERRUPTED"
    if not outcome.ran_rank0:
        err.print(f"{run_label(cfg)}: {outcome.status}; the node that ran rank 0 records it")
        outcome.release()
        return None, str(outcome.status)
    try:
        run_id = dbs[cfg.db.url].record(cfg, outcome)
    except SQLAlchemyError as e:  # the job folder stays: its results are not lost
        cause = " ".join(str(getattr(e, "orig", None) or e).split())
        _one_line(
            f"{run_label(cfg)}: {outcome.status}, but not recorded in {cfg.db.url} "
            f"({type(e).__name__}: {cause}); its config, logs and rank results stay in {outcome.job}"
        )
        return None, "FAILED"
    outcome.release()
    if outcome.status != "OK":
        _one_line(f"run {run_id} {outcome.status}: {outcome.error} (logs: {outcome.log_dir})")
    return run_id, str(outcome.status)


def _on_slurm_launcher(configs: list[RunConfig]) -> bool:
    """Whether the runs go to Slurm; a Slurm sweep has one launcher and one database for all its runs."""
    if not any(c.launch.launcher == "slurm" for c in configs):
        return False
    if len({c.launch.launcher for c in configs}) > 1 or len({c.db.url for c in configs}) > 1:
        _usage("launcher=slurm: a Slurm sweep has one launcher and one db.url for all its runs")
    return True


def _on_slurm(
    configs: list[RunConfig],
    dbs: dict[str, ResultsDB],
    force: bool,
    wait_only: bool,
    as_json: bool,
    sweep: bool,
) -> NoReturn:
    """Submit the runs as Slurm jobs (tpbench.slurm), follow them to their end, show them, exit."""
    from tpbench import slurm

    (db,) = dbs.values()
    try:
        followed = slurm.submit_and_follow(configs, db, force, wait_only, _one_line)
    except KeyboardInterrupt:
        _one_line("stopped following; the Slurm jobs go on: `tpbench sweep ... --wait` follows them again")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except slurm.SubmitError as e:
        _one_line(str(e))
        raise typer.Exit(EXIT_FAILED) from None
    for f in followed:
        if f.run_id is not None and f.status not in ("OK", "skipped"):
            error = db.run_record(f.run_id)["error"]
            _one_line(f"run {f.run_id} {f.status} (Slurm job {f.job_id}): {error}")
    if sweep or as_json:
        _print_sweep([(f.run_id, f.cfg, f.status) for f in followed], dbs, as_json)
    else:
        for f in followed:
            if f.run_id is not None:
                _report_run(db, f.run_id, as_json=False)
    raise typer.Exit(0 if all(f.status in ("OK", "skipped") for f in followed) else EXIT_FAILED)


def _report_run(db: ResultsDB, run_id: int, as_json: bool, full: bool = False) -> None:
    try:
        record = db.run_record(run_id)
    except KeyError:
        _usage(f"run {run_id}: no such run in {db.url}")
    if as_json:
        print(json.dumps(record, default=str))
        return
    text = db.text(run_id)
    if text:
        out.print(text, highlight=False, markup=False)
    if full:
        fields = Table(title=f"run {run_id}", show_header=False)
        for key, value in record.items():
            if key not in ("config", "metrics"):
                fields.add_row(key, str(value))
        out.print(fields)
    if not record["metrics"]:  # a failed run: its one line on stderr says it all
        return
    metrics = Table(title=f"run {run_id} {record['status']}: {record['kind']} {record['mode']}")
    metrics.add_column("metric")
    metrics.add_column("value", justify="right")
    for name, value in sorted(record["metrics"].items()):
        metrics.add_row(name, f"{value:.6g}")
    out.print(metrics)


def _print_sweep(
    ran: list[tuple[int | None, RunConfig, str]], dbs: dict[str, ResultsDB], as_json: bool
) -> None:
    if as_json:
        for run_id, c, _ in ran:
            if run_id is not None:
                print(json.dumps(dbs[c.db.url].run_record(run_id), default=str))
        return
    import pandas as pd

    flat = pd.json_normalize([public_config(c) for _, c, _ in ran])
    varying = [key for key in flat.columns if key != "sweep" and flat[key].astype(str).nunique() > 1]
    table = Table(title=f"sweep {ran[0][1].sweep}" if ran else "sweep: nothing to run")
    for column in ("run", "status", "mode", *varying):
        table.add_column(column)
    for (run_id, c, status), values in zip(ran, flat[varying].itertuples(index=False), strict=True):
        table.add_row(str(run_id), status, mode_label(c.parallel), *map(str, values))
    out.print(table)


def _print_configs(configs: list[RunConfig]) -> None:
    print("\n---\n".join(OmegaConf.to_yaml(public_config(c)) for c in configs), end="")


def _headline(row, metrics: pd.DataFrame) -> str:
    import pandas as pd

    if row.status != "OK":
        return row.error.splitlines()[0][:80] if row.error else ""
    name, fmt = HEADLINE[row.kind]
    if row.id not in metrics.index or name not in metrics.columns or pd.isna(metrics.at[row.id, name]):
        return ""
    return fmt(metrics.at[row.id, name])


def _shown(override: str) -> str:
    """An override as it may be stored (a sweep name): a URL's password hidden."""
    key, sep, value = override.partition("=")
    return f"{key}{sep}{hide_password(value)}" if "://" in value else override


def _one_line(message: str) -> None:
    print(" ".join(message.split()), file=sys.stderr, flush=True)


def _usage(message: str) -> NoReturn:
    _one_line(message)
    raise typer.Exit(EXIT_USAGE)
