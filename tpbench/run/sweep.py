"""Running configs and recording them: what `tpbench run` and `tpbench sweep` do, below the printing.

`configs` composes and checks the runs (tpbench.run.compose), then where their results go: the database
URL (tpbench.db) and, for launcher=slurm, whether this machine can submit (tpbench.run.slurm).
`databases` opens each run's database, `split_done` sets aside what a sweep skips (an OK run of the
config on this node's hardware), and `run_each` launches the rest one by one (tpbench.run.launch), or
consecutive ones that fit one torchrun job on its warm workers (tpbench.run.batch), recording each as it
ends and stopping at an interrupt. Under launcher=slurm,
`tpbench.run.slurm.submit_and_follow` runs them as Slurm jobs instead. Nothing here prints or exits:
progress goes to callbacks and a line for the user to `say`; bad input is a ConfigError.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from tpbench import machine
from tpbench.config import ConfigError, RunConfig, config_hash, run_label
from tpbench.db import ResultsDB, url_refused
from tpbench.results import Outcome, Status
from tpbench.run import collector, compose  # torch loads with launch and batch, once a run is launched


@dataclass
class Ran:
    """One config of a run or sweep, as it ended: its run id (None when nothing was recorded here) and
    its status (a tpbench.results.Status, or "skipped" for a config with an OK run already)."""

    run_id: int | None
    cfg: RunConfig
    status: str


def configs(overrides: Sequence[str], single: bool = False, launching: bool = True) -> list[RunConfig]:
    """Every run the overrides ask for (tpbench.run.compose.expand), each with a database and a launcher
    it can use. Raises ConfigError, one line."""
    runs = compose.expand(overrides, single=single, launching=launching)
    for run in runs:
        check_destination(run)
    return runs


def name(configs: Sequence[RunConfig], given: str | None, overrides: Sequence[str]) -> None:
    """The sweep name stored with each run: its own (a preset's), else `given`, else the overrides but
    where the results go (db.url, db=), which names no setting of the runs, else "default"."""
    named = [o for o in overrides if o.lstrip("+~").partition("=")[0] not in ("db", "db.url")]
    for c in configs:
        c.sweep = c.sweep or given or " ".join(named) or "default"


def check_destination(cfg: RunConfig) -> None:
    """Raise ConfigError, one line, when the run's results cannot go where its config says: a db.url
    that is not a URL or lacks its driver, or launcher=slurm on a machine that cannot submit."""
    refused = url_refused(cfg.db.url)
    if refused:
        raise ConfigError(refused)
    if cfg.launch.launcher == "slurm":
        from tpbench.run.slurm import check_slurm  # submitit itself loads only when a job is submitted

        check_slurm(cfg)


def on_slurm(configs: Sequence[RunConfig]) -> bool:
    """Whether the runs go to Slurm; a Slurm sweep has one launcher and one database for all its runs
    (else ConfigError)."""
    if not any(c.launch.launcher == "slurm" for c in configs):
        return False
    if len({c.launch.launcher for c in configs}) > 1 or len({c.db.url for c in configs}) > 1:
        raise ConfigError("launcher=slurm: a Slurm sweep has one launcher and one db.url for all its runs")
    return True


def databases(configs: Sequence[RunConfig]) -> dict[str, ResultsDB]:
    """Each database the runs write to, by URL, opened (created if need be). Raises DatabaseRefused."""
    return {url: ResultsDB(url) for url in dict.fromkeys(c.db.url for c in configs)}


def split_done(
    configs: Sequence[RunConfig], dbs: dict[str, ResultsDB], force: bool
) -> tuple[list[RunConfig], list[Ran]]:
    """The configs left to run, and those skipped: done is an OK run of the config on this node's
    hardware (tpbench.db); with `force`, nothing is done."""
    finished = {url: db.finished() for url, db in dbs.items()}
    todo, done = [], []
    for c in configs:
        run_id = None if force else finished[c.db.url].get((config_hash(c), machine.here_key(c)))
        (todo.append(c) if run_id is None else done.append(Ran(run_id, c, "skipped")))
    return todo, done


def run_each(
    configs: Sequence[RunConfig],
    dbs: dict[str, ResultsDB],
    on_start: Callable[[RunConfig], Callable[[str], None]],
    say: Callable[[str], None],
) -> Iterator[Ran]:
    """Launch and record each config in turn, yielding each as it ends; an interrupted run is the last.
    Consecutive configs that fit one torchrun job run in one (tpbench.run.batch), each recorded as it ends.
    `on_start(cfg)` is called as a run starts and returns what takes its progress lines."""
    if not configs:  # a sweep whose every config is done: torchrun and torch are not even imported
        return
    with collector.paused():  # torch's import, a third quicker (tpbench.run.collector)
        from tpbench.run import batch

    for group in batch.batches(configs):
        for cfg, outcome in _outcomes(group, on_start):
            ran = (
                Ran(None, cfg, "INTERRUPTED")
                if outcome is None
                else record(cfg, dbs[cfg.db.url], outcome, say)
            )
            yield ran
            if ran.status == "INTERRUPTED":
                return


def _outcomes(
    group: list[RunConfig], on_start: Callable[[RunConfig], Callable[[str], None]]
) -> Iterator[tuple[RunConfig, Outcome | None]]:
    """Each run of a batch as it ends; a batch of one in a job of its own (None: interrupted before
    its agent started or after its job ended, nothing to record)."""
    from tpbench.run import batch, launch

    if len(group) > 1:
        yield from batch.run_batch(group, on_start)
        return
    (cfg,) = group
    try:
        outcome = launch.run_job(cfg, on_start(cfg))
    except KeyboardInterrupt:
        outcome = None
    yield cfg, outcome


def record(cfg: RunConfig, db: ResultsDB, outcome: Outcome, say: Callable[[str], None]) -> Ran:
    """Record one run's Outcome. The run id is None on a node other than the one of rank 0 in a
    multi-node job, which leaves recording to that node, and when the database refused the record."""
    if not outcome.ran_rank0:
        said = f"{run_label(cfg)}: {outcome.status}; the node that ran rank 0 records it"
        if outcome.status is not Status.OK:  # this node's failure, which rank 0's node may not see
            said += f"; on this node: {outcome.error} (logs: {outcome.log_dir})"
        say(said)
        outcome.release()
        return Ran(None, cfg, str(outcome.status))
    try:
        run_id = db.record(cfg, outcome)
    except SQLAlchemyError as e:  # the job folder stays: its results are not lost
        cause = " ".join(str(getattr(e, "orig", None) or e).split())
        say(
            f"{run_label(cfg)}: {outcome.status}, but not recorded in {cfg.db.url} "
            f"({type(e).__name__}: {cause}); its config, logs and rank results stay in {outcome.job}"
        )
        return Ran(None, cfg, "FAILED")
    outcome.release()
    if outcome.status != "OK":
        say(f"run {run_id} {outcome.status}: {outcome.error} (logs: {outcome.log_dir})")
    return Ran(run_id, cfg, str(outcome.status))
