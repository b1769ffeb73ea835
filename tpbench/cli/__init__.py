"""The tpbench command line: one command per verb.

`run` and `sweep` compose configs from conf/ with Hydra overrides, launch torchrun jobs and record them;
`runs` lists and shows what the database holds. Bad input is one line on stderr and exit code 2, with
nothing launched and nothing written; a failed run exits 1, an interrupted one 130.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from tpbench import machine
from tpbench.cli import fit as fit_command
from tpbench.cli import output
from tpbench.cli.arguments import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    AsJson,
    DbOption,
    Device,
    OneLineCommand,
    OneLineGroup,
    Overrides,
    ShowCfg,
    check_filters,
    one_line,
    out_format,
    usage,
    with_db,
)
from tpbench.cli.output import err, out
from tpbench.cli.progress import RunsProgress, command_started, say_estimates
from tpbench.config import DbConfig, RunConfig
from tpbench.results import Status

machine.use_inductor_cache()  # before torch loads, so that a run's workers compile into tpbench's cache

if TYPE_CHECKING:  # pandas and the database (sqlalchemy) are imported where a command needs them:
    from tpbench.db import ResultsDB  # `tpbench plan` starts without them
    from tpbench.run.sweep import Ran

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
app.command(cls=OneLineCommand, epilog=fit_command.EPILOG)(fit_command.fit)


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench run  (the tiny MiniMind, tp=2, validate, memory and throughput)\n\n"
    "tpbench run tp=2 sp=true vp=true layers=64\n\n"
    "tpbench run mode=tp_sp_vp model=minimind kind=memory batch=fixed_global dtype=bfloat16\n\n"
    "tpbench run kind=validate +fault=kill_on_rank1 --json",
)
def run(
    overrides: Overrides = None, cfg: ShowCfg = False, as_json: AsJson = False, db: DbOption = None
) -> None:
    """Run one config (one run per kind; kind=all, the default, is all three) and record it."""
    overrides = with_db(overrides, db)  # refused before torch loads
    from tpbench.run import sweep as sweeping

    configs = _compose(overrides, single=True)
    if cfg:
        output.configs(configs)
        return
    on_slurm = _on_slurm_launcher(configs)
    dbs = _databases(configs)
    if on_slurm:
        _on_slurm(configs, dbs, force=True, wait_only=False, as_json=as_json, sweep=False)
    estimates = [] if as_json else say_estimates(configs, sweep=False)
    _say_where(dbs)
    ran = []
    with RunsProgress(estimates, quiet=as_json, sweep=False, started=command_started()) as progress:
        for r in sweeping.run_each(configs, dbs, progress.on_start, one_line):
            progress.ended(r)
            ran.append(r)
            if r.run_id is not None:
                output.run(dbs[r.cfg.db.url], r.run_id, as_json)
    raise typer.Exit(_exit_code(ran))


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
            help="Sweep name stored with each run \\[default: the preset's name, else the overrides, "
            "db.url left out]."
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
    db: DbOption = None,
) -> None:
    """Run the cartesian product of comma-separated overrides (and of a preset's sweep), skipping
    configs that already have an OK run; a failed run does not stop the sweep. With launcher=slurm every
    run is a Slurm job (one job array) and the command follows them."""
    overrides = with_db(overrides, db)  # refused before torch loads
    from tpbench.run import sweep as sweeping

    configs = _compose(overrides, single=False)
    sweeping.name(configs, name, overrides)
    if cfg:
        output.configs(configs)
        return
    on_slurm = _on_slurm_launcher(configs)
    if wait and not on_slurm:
        usage("--wait follows Slurm jobs: it needs launcher=slurm (a local sweep runs in this shell)")
    dbs = _databases(configs)
    if on_slurm:
        _on_slurm(configs, dbs, force=force, wait_only=wait, as_json=as_json, sweep=True)
    todo, ran = sweeping.split_done(configs, dbs, force)
    estimates = [] if as_json else say_estimates(todo, sweep=True)
    _say_where(dbs)
    with RunsProgress(
        estimates, quiet=as_json, sweep=True, skipped=len(ran), started=command_started()
    ) as progress:
        for r in sweeping.run_each(todo, dbs, progress.on_start, one_line):
            progress.ended(r)
            ran.append(r)
    output.sweep(ran, dbs, as_json)
    raise typer.Exit(_exit_code(ran))


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
    status: Annotated[str | None, typer.Option(help=f"{', '.join(Status)}; any case.")] = None,
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

    status = status.upper() if status else None
    check_filters(status=status, kind=kind, mode=mode)
    try:
        start = parse_since(since) if since else None
    except ValueError:
        usage(f"--since={since}: accepted are an ISO date or time such as 2026-11-30T08:00, or 30m, 12h, 7d")
    results = _read_db(db, listing=True)
    if device is not None and results.runs(device=device).empty:
        _no_such_device(results, device)
    frame = results.runs(status=status, kind=kind, mode=mode, since=start, sweep=sweep, device=device)
    ids = frame["id"].tolist()
    metrics = results.metrics(ids) if ids else pd.DataFrame()
    output.runs(frame, metrics, results.configs(ids), results.url)


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
        usage(f"run id {run_id}: accepted is a number, a run's id as `tpbench runs` lists it")
    output.run(_read_db(db or ctx.obj), int(run_id), as_json, full=True)


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
    fmt: Annotated[
        str | None, typer.Option("--format", help="html, md, csv or json.", show_default=False)
    ] = None,
    out_path: Annotated[
        str | None,
        typer.Option("--out", help="File to write (default: runs/report.html); its extension is the format."),
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
    files beside it), csv or json (the raw rows). An empty selection writes nothing and exits 0; a
    database that does not exist is bad input (exit 2)."""
    from tpbench import report as reporting  # matplotlib loads only for this command

    fmt = out_format(fmt, out_path, reporting.FORMATS, "html")
    check_filters(kind=kind, mode=mode)
    try:
        selection = reporting.Selection.parse(sweep, kind, mode, since, where, device)
        results = _read_db(db)
        if device is not None and results.runs(device=device).empty:
            _no_such_device(results, device)
        path = reporting.write(results, selection, fmt, out_path)
    except reporting.SelectionError as e:
        usage(str(e))
    except reporting.NothingToReport as e:
        one_line(str(e))
        return
    out.print(str(path), highlight=False)


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench plan tp=8 sp=true vp=true model=minimind layers=64\n\n"
    "tpbench plan +preset=seed_tp_memory  (every config of the sweep)\n\n"
    "tpbench plan mode=ddp,tp_sp_vp model=seed_memory precision=mixed\n\n"
    "tpbench plan model=qwen3_0_6b tp=4 --json\n\n"
    "tpbench plan model=qwen3_0_6b tp=8 sp=true gpu=H100-80GB  (predicted for that GPU)",
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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print each config's prediction as one JSON object (a line).")
    ] = False,
) -> None:
    """Print the analytic model's prediction, per rank, without running anything: memory at each moment
    of a training step (the peak marked), collective bytes per step, model FLOPs per step, and the
    time model's step time, its split and MFU: for gpu=NAME, that GPU's (as `tpbench fit` predicts it),
    else the device's here (launch.device=cuda: an H100's). The defaults it assumes are the run's, as
    fit's (tpbench.sizing.defaults), and said: the optimizer, the precision, recompute, micro-batch."""
    from tpbench.cli import sharded
    from tpbench.config import ConfigError
    from tpbench.experiments import memory
    from tpbench.parallel import emulation
    from tpbench.predict import steptime, theory
    from tpbench.sizing import defaults
    from tpbench.sizing.estimate import worker_threads

    try:  # gpu=NAME: a GPU's prediction, its rates and its allocator's (launch.emulate_gpu)
        given = defaults.for_gpu(overrides or [])
    except ConfigError as e:
        usage(str(e))
    configs = _compose([*given, *(["launch.emulate=fake"] if measure else [])], single=False, launching=False)
    for c in (c for c in configs if c.kind == configs[0].kind):  # kind=all: one config per kind
        prediction = theory.predict(c)
        measured = memory.measure_busiest(c) if measure else None
        timed = steptime.predict_time(c, steptime.rates_for(c, threads=worker_threads(c)))
        if as_json:
            said = output.plan_dict(c, prediction, theory.model_flops_per_step(c), measured)
            print(json.dumps(said | timed.fields() | {"assumed": defaults.assumed_dict(c)}))
            continue
        output.plan(c, prediction, theory.model_flops_per_step(c))
        out.print(defaults.assumed(c))
        sharded.split_table(c, prediction)
        sharded.levels_table(c)
        output.step_time(c, timed)
        output.depth(sharded.unsharded(c))  # the depth model's modes are DP replicas
        if measured is not None:
            output.measured(c, prediction, *measured, emulation.emulated_rank(c))


@app.command(
    cls=OneLineCommand,
    epilog="Examples:\n\n"
    "tpbench diagram tp=4 sp=true  (runs/diagram.svg)\n\n"
    "tpbench diagram tp=4 kv_heads=2 --compare  (TP and TP+SP side by side)\n\n"
    "tpbench diagram tp=4 sp=true vp=true --format png --out block.png",
)
def diagram(
    overrides: Overrides = None,
    fmt: Annotated[str | None, typer.Option("--format", help="svg or png.", show_default=False)] = None,
    out_path: Annotated[
        str | None,
        typer.Option("--out", help="File to write (default: runs/diagram.svg); its extension is the format."),
    ] = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Draw the same config without and with SP, side by side.")
    ] = False,
) -> None:
    """Draw one transformer block at TP = T from a traced training step (every rank emulated in this
    process on torch's fake process group): each module, each rank's weight shard (math view W \\[in, out]
    and nn.Linear view \\[out, in]), each activation's per-rank shape, and every collective, forward and
    backward, with its type, group and bytes. One layer is traced, whatever model.num_hidden_layers says."""
    from pathlib import Path

    from tpbench import diagram as diagrams  # torch and graphviz load only for this command

    fmt = out_format(fmt, out_path, diagrams.FORMATS, "svg")
    path = Path(out_path) if out_path is not None else diagrams.default_path(fmt)
    try:
        configs = diagrams.configs(overrides or [], compare)
        diagrams.check_writable(path)
    except diagrams.ConfigError as e:
        usage(str(e))
    drawn = diagrams.render([diagrams.trace(c) for c in configs], fmt)
    path.write_bytes(drawn)
    out.print(str(path), highlight=False)


# -- helpers -----------------------------------------------------------------------------------------


def _compose(overrides: list[str], single: bool, launching: bool = True) -> list[RunConfig]:
    from tpbench.config import ConfigError
    from tpbench.run import sweep as sweeping  # torch loads only for the commands that launch

    try:
        return sweeping.configs(overrides, single=single, launching=launching)
    except ConfigError as e:
        usage(str(e))


def _databases(configs: list[RunConfig]) -> dict[str, ResultsDB]:
    from tpbench.db import DatabaseRefused
    from tpbench.run import sweep as sweeping

    try:
        return sweeping.databases(configs)
    except DatabaseRefused as e:
        usage(str(e))


def _say_where(dbs: dict[str, ResultsDB]) -> None:
    """Where the runs are recorded, once on stderr: `tpbench runs --db URL` lists them."""
    one_line(f"recording in {', '.join(db.url for db in dbs.values())}")


def _read_db(url: str, listing: bool = False) -> ResultsDB:
    """The database at `url`, created by nothing. None there: for a listing (`runs`), no runs yet, said
    and exit 0; for a command that reads a run or writes a report, bad input, exit 2."""
    from tpbench.db import DatabaseRefused, NoDatabase, ResultsDB

    try:
        return ResultsDB(url, create=False)
    except NoDatabase as e:
        if not listing:
            usage(str(e))
        err.print(str(e))
        raise typer.Exit(0) from None
    except DatabaseRefused as e:
        usage(str(e))


def _no_such_device(db: ResultsDB, device: str) -> NoReturn:
    """--device that no run's hardware holds: one line naming what the database has, exit 0 as for an
    empty selection."""
    kinds = "; ".join(db.hardware_kinds()) or "none: it has no runs"
    one_line(f"--device {device}: no run in {db.url} ran on such hardware; its hardware: {kinds}")
    raise typer.Exit(0)


def _on_slurm_launcher(configs: list[RunConfig]) -> bool:
    from tpbench.config import ConfigError
    from tpbench.run import sweep as sweeping

    try:
        return sweeping.on_slurm(configs)
    except ConfigError as e:
        usage(str(e))


def _on_slurm(
    configs: list[RunConfig],
    dbs: dict[str, ResultsDB],
    force: bool,
    wait_only: bool,
    as_json: bool,
    sweep: bool,
) -> NoReturn:
    """Submit the runs as Slurm jobs (tpbench.run.slurm), follow them to their end, show them, exit."""
    from tpbench.run import slurm
    from tpbench.run.sweep import Ran

    (db,) = dbs.values()
    try:
        followed = slurm.submit_and_follow(configs, db, force, wait_only, one_line)
    except KeyboardInterrupt:
        one_line("stopped following; the Slurm jobs go on: `tpbench sweep ... --wait` follows them again")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except slurm.SubmitError as e:
        one_line(str(e))
        raise typer.Exit(EXIT_FAILED) from None
    for f in followed:
        if f.run_id is not None and f.status not in ("OK", "skipped"):
            error = db.run_record(f.run_id)["error"]
            one_line(f"run {f.run_id} {f.status} (Slurm job {f.job_id}): {error}")
    if sweep or as_json:
        output.sweep([Ran(f.run_id, f.cfg, f.status) for f in followed], dbs, as_json)
    else:
        for f in followed:
            if f.run_id is not None:
                output.run(db, f.run_id, as_json=False)
    raise typer.Exit(0 if all(f.status in ("OK", "skipped") for f in followed) else EXIT_FAILED)


def _exit_code(ran: list[Ran]) -> int:
    """130 when the last run was interrupted, else 1 when any run did not end OK, else 0."""
    if ran and ran[-1].status == "INTERRUPTED":
        return EXIT_INTERRUPTED
    return EXIT_FAILED if any(r.status not in ("OK", "skipped") for r in ran) else 0
