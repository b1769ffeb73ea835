"""Runs as Slurm jobs (`launcher=slurm`), submitted through submitit.

Each run is one Slurm job of launch.nnodes nodes; the runs of one command are one job array, at most
launch.max_parallel running at once. In the job, submitit starts `SlurmRun` on every node (srun, one
task per node), which runs torchrun's agent there (tpbench.run.launch.run_job) with the rendezvous at the
first node; the node of global rank 0 records the run, with its Slurm job id and node list, into
db.url, which every node must reach.

The submitting command only follows: it reads each job's state from Slurm (sacct, through submitit) and
the database, prints every change (pending, running, done, failed, with the job id), and records the
runs that Slurm ended before they could record themselves: cancelled, node failure, time limit
(TIMEOUT), out of memory (OOM), preempted (INTERRUPTED, when launch.slurm.on_preempt=interrupted;
`requeue` lets Slurm run the job again from the start). Which job runs which config is kept in
launch.slurm.folder/jobs.jsonl, so the same sweep again, or `tpbench sweep --wait`, follows the jobs
after the submitting shell went away, and submits only what has neither a record nor a live job.
A job never runs a config that already has an OK run on its node's hardware (unless forced), nor
records a job id twice.

The hardware (tpbench.predict.hardware, part of a run's identity with its config) is the job's own: the
submitting host cannot see the nodes a job will get. So the job probes its node, records what its ranks
saw, and checks there whether its config has an OK run on that hardware. Before submitting, the command
skips only a config whose last job of the same Slurm request (partition, GPUs per node, sbatch lines:
what picks the nodes) recorded an OK run; any other config gets a job, which ends at once, without a
record, where its hardware has one (shown as skipped). Jobs submitted by a tpbench before the request
was kept in jobs.jsonl match no request.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.engine import URL, make_url

from tpbench import machine
from tpbench.config import ConfigError, RunConfig, config_hash, run_label
from tpbench.db import ResultsDB
from tpbench.results import Outcome, Status
from tpbench.run.launch import probe, run_job

# Slurm's job states that are not an ending (a requeued job passes through PREEMPTED and REQUEUED).
LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "UNKNOWN")
# How Slurm ended a job that did not record its run; COMPLETED without a record is a FAILED run too.
ENDINGS = {
    "CANCELLED": Status.CANCELLED,
    "NODE_FAIL": Status.NODE_FAIL,
    "TIMEOUT": Status.TIMEOUT,
    "DEADLINE": Status.TIMEOUT,
    "OUT_OF_MEMORY": Status.OOM,
    "PREEMPTED": Status.INTERRUPTED,
}
STOP_BEFORE_LIMIT_S = 180  # the run's own job timeout, before Slurm's time limit and submitit's signal
# Multi-node jobs: the c10d rendezvous on the first node, at RDZV_PORT + the job's own id % RDZV_PORTS.
# Each task of an array is a job of its own (SLURM_JOB_ID), so two tasks sharing a first node differ;
# the range ends below Linux's ephemeral ports (32768).
RDZV_PORT, RDZV_PORTS = 29400, 3000
PASSWORD_ENV = "TPBENCH_DB_PASSWORD"  # the database password reaches the job in its environment only
POLL_S = 2.0


def check_slurm(cfg: RunConfig) -> None:
    """Raise ConfigError, one line, when this machine cannot submit the run to Slurm."""
    slurm = cfg.launch.slurm
    if importlib.util.find_spec("submitit") is None:
        raise ConfigError(
            "launcher=slurm needs submitit, which is not installed: pip install 'tpbench[slurm]'"
        )
    if shutil.which("sbatch") is None:
        raise ConfigError("launcher=slurm: no sbatch on PATH; accepted here is launcher=local")
    if slurm.time_min * 60 <= STOP_BEFORE_LIMIT_S + 60:
        raise ConfigError(
            f"launch.slurm.time_min={slurm.time_min}: accepted are minutes >= 5 (a run stops "
            f"{STOP_BEFORE_LIMIT_S // 60} minutes before the job's time limit, to record itself)"
        )
    for line in slurm.sbatch:
        _sbatch_option(line)


class SubmitError(Exception):
    """sbatch refused the jobs; one line says why."""


@dataclass
class Followed:
    """One config of the command and the Slurm job that runs it."""

    cfg: RunConfig
    job_id: str | None = None  # None: not submitted (--wait found no job for it)
    submitted_at: datetime | None = None
    state: str = ""  # Slurm's, as last seen
    run_id: int | None = None
    status: str = ""  # the run's, once recorded; "skipped" when its config had an OK run already


def submit_and_follow(
    configs: list[RunConfig],
    db: ResultsDB,
    force: bool,
    wait_only: bool,
    say: Callable[[str], None],
) -> list[Followed]:
    """Submit what needs a job (nothing with wait_only), then follow every job to its end."""
    import submitit

    index = _Index(Path(configs[0].launch.slurm.folder))
    request = _request(configs[0])
    followed, to_submit = [], []
    for cfg in configs:
        item = Followed(cfg)
        followed.append(item)
        known = index.latest(config_hash(cfg), request)
        if known is not None:
            done = db.run_of_job(known[0])
            # on the hardware this request got; --wait follows the job, so it says how the job went
            # even where it ended OK before this command came (`_follow` finds it recorded at once)
            if not force and not wait_only and done is not None and done[1] == "OK":
                item.run_id, item.status = done[0], "skipped"
                continue
            item.job_id, item.submitted_at = known
            info = _info(item.job_id)
            item.state = (info.get("State") or "UNKNOWN").split()[0]
            if wait_only or item.state in LIVE:
                continue
            if db.run_of_job(item.job_id) is None:  # ended while nobody followed: record how, first
                _record_ending(item, info, db, submitit)
            item = Followed(cfg)
            followed[-1] = item
        if not wait_only:
            to_submit.append(item)
    if to_submit:
        executor = _executor(to_submit[0].cfg)
        jobs = []
        try:
            with executor.batch():
                for item in to_submit:
                    jobs.append(executor.submit(SlurmRun(_job_config(item.cfg), force)))
        except Exception as e:  # submitit raises sbatch's refusal as a plain error with its stderr
            raise SubmitError(f"sbatch refused the jobs: {' '.join(str(e).split())[:500]}") from None
        now = _now()
        for item, job in zip(to_submit, jobs, strict=True):
            item.job_id, item.submitted_at = job.job_id, now
            index.add(config_hash(item.cfg), request, job.job_id, now)
            say(f"{job.job_id} submitted: {run_label(item.cfg)}")
    for item in followed:
        if item.job_id is None and not item.status:
            item.status = "not submitted"
            say(f"{run_label(item.cfg)}: no job was submitted for it; run the sweep without --wait")
    _follow([f for f in followed if f.job_id and not f.status], db, say, submitit)
    return followed


def _follow(items: list[Followed], db: ResultsDB, say: Callable[[str], None], submitit) -> None:
    watcher = submitit.SlurmJob.watcher
    while True:
        open_items = [item for item in items if not item.status]
        if not open_items:
            return
        watcher.update()  # one sacct for every job
        changed = False
        for item in open_items:
            info = watcher.get_info(item.job_id, mode="cache")
            state = (info.get("State") or "UNKNOWN").split()[0]  # UNKNOWN: not in sacct yet
            if state != item.state and state != "UNKNOWN":
                item.state, changed = state, True
                nodes = f" on {info['NodeList']}" if info.get("NodeList", "None") != "None" else ""
                say(f"{item.job_id} {state}{nodes}: {run_label(item.cfg)}")
            recorded = db.run_of_job(item.job_id)
            if recorded is None and _ended(item):
                recorded = db.run_of_job(item.job_id)  # it may have recorded itself just before ending
                if recorded is None:
                    recorded = _record_ending(item, info, db, submitit)
            if recorded is not None:
                item.run_id, item.status = recorded
                say(f"{item.job_id} run {item.run_id} {item.status}: {run_label(item.cfg)}")
            elif _ended(item) and item.state == "COMPLETED":  # the job found the config done elsewhere
                item.status = "skipped"
            changed |= bool(item.status)
        if changed:
            say(_progress(items))
        time.sleep(POLL_S)


def _progress(items: list[Followed]) -> str:
    """pending / running / done / failed over the jobs followed."""
    pending = sum(not i.status and i.state not in ("RUNNING", "COMPLETING") for i in items)
    running = sum(not i.status and i.state in ("RUNNING", "COMPLETING") for i in items)
    done = sum(i.status in ("OK", "skipped") for i in items)
    failed = sum(bool(i.status) and i.status not in ("OK", "skipped") for i in items)
    return f"jobs: {pending} pending · {running} running · {done} done · {failed} failed"


def _ended(item: Followed) -> bool:
    if not item.state:  # not seen in sacct yet
        return False
    if item.state == "PREEMPTED":  # requeued, unless the job was submitted --no-requeue
        return item.cfg.launch.slurm.on_preempt == "interrupted"
    return item.state not in LIVE


def _record_ending(item: Followed, info: dict, db: ResultsDB, submitit) -> tuple[int, str] | None:
    """The run of a job that Slurm ended before it recorded itself; None for a job that completed
    without recording (it found its config done by another run)."""
    job = submitit.SlurmJob(item.cfg.launch.slurm.folder, item.job_id)
    if item.state == "COMPLETED":
        return None
    status = ENDINGS.get(item.state, Status.FAILED)
    error = f"Slurm ended job {item.job_id}: {info.get('State', item.state)}"
    if status is Status.FAILED:
        error += f": {_last_error(job)}"
    nodes = info.get("NodeList") if info.get("NodeList", "None") != "None" else None
    unseen = (f"not reported (Slurm ended job {item.job_id} first)", 0)  # the job's node said nothing
    env = dataclasses.replace(probe(item.cfg, unseen), slurm_job_id=item.job_id, nodes=nodes)
    env.host = nodes or env.host
    log_dir = str(job.paths.folder)
    outcome = Outcome(status, item.submitted_at or _now(), _now(), env, error=error, log_dir=log_dir)
    return db.record(item.cfg, outcome), str(status)


def _last_error(job) -> str:
    """What the job's own stderr ended with (a traceback's last line)."""
    try:
        lines = [line for line in job.paths.stderr.read_text().splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1].strip()[:300] if lines else "no log"


class SlurmRun:
    """What each node of the job runs (pickled by submitit): torchrun's agent for its ranks, then, on the
    node of rank 0, the record. Returns the run id, or None (another node records; or nothing to do)."""

    def __init__(self, cfg: RunConfig, force: bool):
        self.cfg, self.force = cfg, force

    def __call__(self) -> int | None:
        import submitit

        env = submitit.JobEnvironment()
        job_id = env.job_id
        cfg = _on_this_node(self.cfg, env)
        db = ResultsDB(_with_password(cfg.db.url)) if env.node == 0 else None
        if db is not None:
            recorded = db.run_of_job(job_id)
            if recorded is not None:  # a requeued job whose run was recorded before
                return recorded[0]
            if not self.force and (config_hash(cfg), machine.here_key(cfg)) in db.finished():
                return None  # done on this node's hardware
        outcome = run_job(cfg)
        if outcome.status is Status.INTERRUPTED:
            # Slurm stopped the job (scancel, time limit, preemption): the command following it records
            # the run with Slurm's reason.
            raise RuntimeError(f"job {job_id} stopped by a signal: {outcome.error}")
        if not outcome.ran_rank0:
            return None
        if db is None:  # rank 0 ran on a node other than the first: open the database there
            db = ResultsDB(_with_password(cfg.db.url))
        return db.record(cfg, outcome)


def _on_this_node(cfg: RunConfig, env) -> RunConfig:
    """The config as this node of the job runs it (`env`: submitit's JobEnvironment): nodes,
    rendezvous and job timeout from Slurm. A multi-node job's rendezvous port comes from its own job
    id (SLURM_JOB_ID), which an array's tasks do not share, unlike `env.job_id`'s "<array>_<task>"."""
    cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch))
    launch, hostnames = cfg.launch, list(env.hostnames)
    launch.nnodes, launch.node_rank = str(len(hostnames)), env.node
    if len(hostnames) > 1:
        port = RDZV_PORT + int(env.raw_job_id) % RDZV_PORTS
        launch.rdzv_endpoint, launch.rdzv_id = f"{hostnames[0]}:{port}", f"slurm-{env.job_id}"
    launch.job_timeout_s = min(launch.job_timeout_s, launch.slurm.time_min * 60 - STOP_BEFORE_LIMIT_S)
    return cfg


def _request(cfg: RunConfig) -> str:
    """What picks the nodes a job gets: partition, GPUs per node, sbatch lines (e.g. --constraint)."""
    slurm = cfg.launch.slurm
    return json.dumps(
        {"partition": slurm.partition, "gpus_per_node": slurm.gpus_per_node, "sbatch": slurm.sbatch}
    )


def _executor(cfg: RunConfig):
    import submitit

    slurm, launch = cfg.launch.slurm, cfg.launch
    ranks_per_node = launch.nproc_per_node or cfg.parallel.tp * cfg.parallel.dp // int(launch.nnodes)
    executor = submitit.SlurmExecutor(folder=Path(slurm.folder) / "%j", max_num_timeout=0)
    extra: dict[str, object] = {"requeue" if slurm.on_preempt == "requeue" else "no-requeue": True}
    extra.update(_sbatch_option(line) for line in slurm.sbatch)
    executor.update_parameters(
        job_name="tpbench",
        nodes=int(launch.nnodes),
        ntasks_per_node=1,  # one torchrun agent per node; it starts the node's ranks
        cpus_per_task=ranks_per_node * slurm.cpus_per_rank,
        time=slurm.time_min,
        array_parallelism=launch.max_parallel,
        additional_parameters=extra,
        **({"partition": slurm.partition} if slurm.partition else {}),
        **({"account": slurm.account} if slurm.account else {}),
        **({"gpus_per_node": slurm.gpus_per_node} if slurm.gpus_per_node else {}),
        **({"mem": f"{slurm.mem_gb:g}G"} if slurm.mem_gb else {}),
    )
    return executor


def _job_config(cfg: RunConfig) -> RunConfig:
    """The config the job gets (pickled into launch.slurm.folder): no password in it, SQLite's path
    absolute (the job's working folder may differ). The password travels in the job's environment."""
    url = make_url(cfg.db.url)
    if url.password:
        os.environ[PASSWORD_ENV] = url.password  # sbatch passes the submitting environment on
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).is_absolute():
        url = url.set(database=str(Path(url.database).resolve()))
    # URL.set(password=None) means "unchanged": build the URL again without it.
    public = URL.create(url.drivername, url.username, None, url.host, url.port, url.database, url.query)
    public = public.render_as_string(hide_password=False)
    return dataclasses.replace(cfg, db=dataclasses.replace(cfg.db, url=public))


def _with_password(url: str) -> str:
    password = os.environ.get(PASSWORD_ENV)
    if not password:
        return url
    return make_url(url).set(password=password).render_as_string(hide_password=False)


def _sbatch_option(line: str) -> tuple[str, object]:
    """ "--qos=high" (or "#SBATCH --qos=high") -> ("qos", "high"); "--exclusive" -> ("exclusive", True)."""
    option = line.removeprefix("#SBATCH").strip()
    if not option.startswith("--") or len(option) < 3 or " " in option.split("=")[0]:
        raise ConfigError(
            f"launch.slurm.sbatch has {line!r}: accepted are sbatch long options, e.g. '--qos=high', "
            f"'--exclusive'"
        )
    key, sep, value = option[2:].partition("=")
    return key, value if sep else True


def _info(job_id: str) -> dict[str, str]:
    """Slurm's JobID, State and NodeList of one job (sacct, through submitit)."""
    import submitit

    return submitit.SlurmJob.watcher.get_info(job_id, mode="force")


class _Index:
    """launch.slurm.folder/jobs.jsonl: one line per submitted job, which config it runs, asking for which
    nodes (`_request`)."""

    def __init__(self, folder: Path):
        self.path = folder / "jobs.jsonl"

    def latest(self, config: str, request: str) -> tuple[str, datetime] | None:
        if not self.path.exists():
            return None
        found = None
        for line in self.path.read_text().splitlines():
            entry = json.loads(line)
            if entry["config_hash"] == config and entry.get("request") == request:
                found = entry["job_id"], datetime.fromisoformat(entry["submitted_at"])
        return found

    def add(self, config: str, request: str, job_id: str, at: datetime) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"config_hash": config, "request": request, "job_id": job_id, "submitted_at": at.isoformat()}
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)
