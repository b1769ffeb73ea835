"""Launch one run as a torchrun job and say how it ended.

The parent process (the CLI) is torchrun's elastic agent: `elastic_launch` starts tp x dp workers
(`python -m tpbench.run.worker JOB_DIR`) with no restarts, each writing its stdout/stderr to a log file in
the job folder. The job folder holds the resolved config, the workers' pid files, their logs and
error files, and the rank results. A job ends OK, FAILED, OOM, TIMEOUT (a collective past
launch.collective_timeout_s, or a worker past launch.job_timeout_s) or INTERRUPTED (Ctrl-C), with the
first failing rank and its message. The parent alone writes the database, from the `Outcome`.

Workers are fresh processes (torch elastic's subprocess context), each importing torch (2.4 s of CPU
here). Forking them from a preloaded forkserver (a function entrypoint) would save that, but torch
elastic's multiprocessing context reports one failed process only, the first that
torch.multiprocessing's join finds ended, while naming the first failing rank needs every rank's exit
code: a rank killed by a signal leaves no error file, and its peers fail after it with theirs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, ProcessFailure, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from tpbench import machine
from tpbench.config import RunConfig, config_hash, local_world_size, save_run_config, world_size
from tpbench.parallel import emulation
from tpbench.results import Environment, Outcome, RankResult, Status

REPO = Path(__file__).resolve().parents[2]

# Errors a rank sees because another rank died first: never the first failure when there is another.
PEER_ERRORS = ("closed by peer", "reset by peer", "Broken pipe", "remote worker", "remote process")
OOM_ERRORS = ("OutOfMemoryError", "MemoryError", "out of memory", "can't allocate memory", "not enough memor")
TIMEOUT_ERRORS = re.compile(r"timed out|timing out|timeout", re.IGNORECASE)
# What ProcessGroupNCCL's watchdog writes before it aborts the process (SIGABRT) on a timed-out collective
WATCHDOG = re.compile(
    r"Watchdog caught collective operation timeout|ran for \d+ milliseconds before timing out"
)
AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # what the agent traps


def probe(cfg: RunConfig, devices: tuple[str, int] | None = None) -> Environment:
    """This node before the launch (`run_job` then takes the device name from what its ranks saw);
    `devices`: the device name and count to record instead of this node's."""
    commit = _git("rev-parse", "HEAD")
    device_name, device_count = devices or machine.here(cfg)
    return Environment(
        host=socket.gethostname(),
        device=cfg.launch.device,
        device_name=device_name,
        device_count=device_count,
        backend="fake" if emulation.emulated(cfg) else cfg.launch.backend,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        git_commit=commit,
        git_dirty=None if commit is None else bool(_git("status", "--porcelain")),
        slurm_job_id=_slurm_job_id(),
        nodes=os.environ.get("SLURM_JOB_NODELIST"),
    )


class JobFailed(Exception):
    def __init__(self, status: Status, message: str, rank: int | None = None):
        super().__init__(message)
        self.status, self.message, self.rank = status, message, rank


def run_job(cfg: RunConfig, on_progress: Callable[[str], None] = lambda line: None) -> Outcome:
    """Run `cfg` as a torchrun job on this node and wait for it; a failed job is an Outcome, not an error."""
    job = new_job(cfg)
    env, started, load = probe(cfg), now(), load_before()
    try:
        _launch(cfg, job, on_progress)
        status, error, rank, results = judged(cfg, job)
    except JobFailed as e:
        status, error, rank, results = e.status, e.message, e.rank, []
    finally:
        _reap(job)
    ran_rank0 = int(cfg.launch.nnodes) == 1 or (job / "pids" / "rank0.pid").exists()
    return outcome(cfg, job, env, started, (status, error, rank, results), ran_rank0, load)


def new_job(cfg: RunConfig) -> Path:
    """A fresh job folder (under TMPDIR) holding the resolved config, and a folder for the pid files."""
    job = Path(tempfile.mkdtemp(prefix="tpbench-job-"))
    (job / "pids").mkdir()
    save_run_config(cfg, job / "config.yaml")
    return job


def judged(cfg: RunConfig, job: Path) -> tuple[Status, str, int | None, list[RankResult]]:
    """A job that ran to its end, judged by what its ranks wrote: status, error, failing rank and the
    results. Raises JobFailed for a result missing, too big or unreadable."""
    results = _read_results(cfg, job / "results")
    failed = [(r.rank, check) for r in results for check in r.failed]
    if failed:  # the job ran, and what it measured says the run is wrong: kept, and FAILED
        error = f"{cfg.kind} out of bounds: " + "; ".join(check for _, check in failed)
        return Status.FAILED, error, failed[0][0], results
    return Status.OK, "", None, results


def load_before() -> tuple[float, int]:
    """This machine's load (the 1-minute load average: runnable and running processes) and its cores,
    read before a job's ranks start, so without them; a throughput run records both (`outcome`)."""
    return os.getloadavg()[0], os.cpu_count() or 1


def outcome(
    cfg: RunConfig,
    job: Path,
    env: Environment,
    started: datetime,
    ended: tuple[Status, str, int | None, list[RankResult]],
    ran_rank0: bool = True,
    load: tuple[float, int] | None = None,
) -> Outcome:
    """The Outcome of the run of job folder `job`: `ended` is its status, error, failing rank and
    results; the device name is the one its ranks saw, if they said. A throughput run's rank 0 gets
    `load` (`load_before` its job) as the metrics load_before_job and cpu_cores, beside its step CPU
    time: the report marks a run timed on a machine with more runnable work than cores."""
    status, error, rank, results = ended
    if load is not None and cfg.kind == "throughput" and results:
        first = min(results, key=lambda r: r.rank)
        first.add("load_before_job", load[0])
        first.add("cpu_cores", load[1])
    env = dataclasses.replace(env, device_name=machine.ranks_device_name(job) or env.device_name)
    kept = None if status is Status.OK else str(job)
    return Outcome(status, started, now(), env, results, error, rank, kept, ran_rank0, job)


def _launch(cfg: RunConfig, job: Path, on_progress: Callable[[str], None]) -> None:
    """Run the elastic agent until every worker has ended; every bad ending becomes a JobFailed."""
    handlers = {sig: signal.getsignal(sig) for sig in AGENT_SIGNALS}
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # until the agent takes over: as Ctrl-C
    try:
        with agent_log(job / "launcher.log"), Tail(job / "logs", on_progress):
            elastic_launch(launch_config(cfg, job), sys.executable)("-m", "tpbench.run.worker", str(job))
    except BaseException as e:
        raise failure_of(e, cfg, job) from None
    finally:
        for sig, handler in handlers.items():  # the agent leaves its own handlers installed
            signal.signal(sig, handler)


def failure_of(e: BaseException, cfg: RunConfig, job: Path) -> JobFailed:
    """What an exception out of `elastic_launch` says of the run of `cfg` (job folder `job`: its logs)."""
    if isinstance(e, ChildFailedError):
        return _first_failure(e.failures, cfg, job)
    if isinstance(e, SignalException):
        return JobFailed(Status.INTERRUPTED, f"interrupted by {e.sigval.name}")
    if isinstance(e, KeyboardInterrupt):
        return JobFailed(Status.INTERRUPTED, "interrupted by SIGINT")
    if isinstance(e, Exception):  # the rendezvous or the agent failed: no worker ran to the end
        return JobFailed(Status.FAILED, f"launch failed: {type(e).__name__}: {e}")
    raise e


def launch_config(cfg: RunConfig, job: Path) -> LaunchConfig:
    launch, nnodes = cfg.launch, int(cfg.launch.nnodes)
    rdzv_configs: dict[str, object] = {"rank": launch.node_rank} if launch.rdzv_backend == "static" else {}
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=local_world_size(cfg),
        logs_specs=DefaultLogsSpecs(log_dir=str(job / "logs"), redirects=Std.ALL),
        # One node: a fresh rendezvous on a free port (as torchrun --standalone). Several: every node
        # derives the same id from the config, so the nodes of one sweep meet run after run.
        run_id=f"tpbench-{uuid.uuid4().hex}" if nnodes == 1 else f"{launch.rdzv_id}-{config_hash(cfg)}",
        rdzv_backend=launch.rdzv_backend,
        rdzv_endpoint=launch.rdzv_endpoint or "localhost:0",
        rdzv_configs=rdzv_configs,
        max_restarts=0,
        **_SHUTDOWN_TIMEOUT,
    )


# Workers get 5 s between SIGTERM and SIGKILL when a job ends, not the default 30: a field torch 2.12
# added. On an older torch (2.11 on a GPU image: benchmarks/gpu-check.sh) the default stays.
_SHUTDOWN_TIMEOUT = {"shutdown_timeout": 5} if hasattr(LaunchConfig, "shutdown_timeout") else {}


def _read_results(cfg: RunConfig, folder: Path) -> list[RankResult]:
    if not (folder / "rank0.json").exists() and int(cfg.launch.nnodes) > 1:
        return []  # rank 0 ran on another node, which records the run
    results = []
    for rank in [emulation.emulated_rank(cfg)] if emulation.emulated(cfg) else range(world_size(cfg)):
        path = folder / f"rank{rank}.json"
        if not path.exists():
            raise JobFailed(Status.FAILED, f"rank {rank} ended without a result", rank)
        size_mb = path.stat().st_size / 2**20
        if size_mb > cfg.launch.max_result_mb:
            limit = cfg.launch.max_result_mb
            message = f"rank {rank} wrote a {size_mb:.1f} MB result, over launch.max_result_mb={limit:g}"
            raise JobFailed(Status.FAILED, message, rank)
        try:
            results.append(RankResult.load(path))
        except (ValueError, KeyError, TypeError) as e:
            raise JobFailed(Status.FAILED, f"rank {rank} wrote an unreadable result ({e})", rank) from None
    return results


def _first_failure(failures: dict[int, ProcessFailure], cfg: RunConfig, job: Path) -> JobFailed:
    """The rank that failed first. The agent lists the ranks it stopped (SIGTERM) as failures too, and
    a rank whose peer died fails with a connection error: both come after every other failure."""

    def order(item: tuple[int, ProcessFailure]) -> tuple[bool, int]:
        _, failure = item
        stopped = failure.exitcode == -signal.SIGTERM
        consequence = stopped or any(p in _message(failure) for p in PEER_ERRORS)
        has_file = os.path.isfile(failure.error_file)
        return consequence, os.stat(failure.error_file).st_mtime_ns if has_file else failure.timestamp * 10**9

    rank, failure = min(failures.items(), key=order)
    message = _message(failure)
    if failure.exitcode == -signal.SIGTERM:
        # every failure came after a rank was stopped by SIGTERM that the agent did not send (it sends
        # it only after a failure, which would come first): the job was stopped from outside (Slurm's
        # scancel, time limit or preemption signal every process of the job, the ranks too, and a rank
        # can die of it before the agent hears its own)
        return JobFailed(Status.INTERRUPTED, f"rank {rank} stopped from outside the job: {message}", rank)
    if failure.exitcode == -signal.SIGALRM:
        return JobFailed(
            Status.TIMEOUT, f"rank {rank} ran past launch.job_timeout_s={cfg.launch.job_timeout_s:g}", rank
        )
    if failure.exitcode == -signal.SIGABRT:  # NCCL's watchdog aborts the process past the timeout
        watchdog = _watchdog_line(job, failure.local_rank)
        if watchdog:
            limit = cfg.launch.collective_timeout_s
            return JobFailed(
                Status.TIMEOUT, f"rank {rank}: {watchdog} (launch.collective_timeout_s={limit:g})", rank
            )
    if any(m in message for m in OOM_ERRORS):
        return JobFailed(Status.OOM, f"rank {rank}: {message}", rank)
    if TIMEOUT_ERRORS.search(message):
        limit = cfg.launch.collective_timeout_s
        return JobFailed(
            Status.TIMEOUT, f"rank {rank}: {message} (launch.collective_timeout_s={limit:g})", rank
        )
    return JobFailed(Status.FAILED, f"rank {rank}: {message}", rank)


def _watchdog_line(job: Path, local_rank: int, tail_bytes: int = 1 << 16) -> str | None:
    """The line of a rank's stderr in which NCCL's watchdog reports a collective timeout, if any."""
    for log in (job / "logs").glob(f"*/attempt_0/{local_rank}/stderr.log"):
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - tail_bytes))
            for line in f.read().decode(errors="replace").splitlines():
                if WATCHDOG.search(line):
                    return " ".join(line.split())[:300]
    return None


def _message(failure: ProcessFailure) -> str:
    message = failure.message
    return message["message"] if isinstance(message, dict) else message


def _reap(job: Path) -> None:
    """Kill any worker of this job still alive (the agent stops them; this makes sure)."""
    for pid_file in (job / "pids").glob("rank*.pid"):
        pid = int(pid_file.read_text())
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(job).encode() in cmdline:
            os.kill(pid, signal.SIGKILL)


class Tail:
    """Calls on_progress with the last line of rank 0's stdout, twice a second, while a job runs."""

    def __init__(self, logs: Path, on_progress: Callable[[str], None]):
        self.logs, self.on_progress = logs, on_progress
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> Tail:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _follow(self) -> None:
        while not self.stop.wait(0.5):
            for log in self.logs.glob("*/attempt_0/0/stdout.log"):
                line = _last_line(log)
                if line:
                    self.on_progress(line)


def _last_line(path: Path, tail_bytes: int = 4096) -> str:
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - tail_bytes))
        lines = f.read().decode(errors="replace").splitlines()
    return lines[-1].strip()[:160] if lines else ""


@contextmanager
def agent_log(path: Path) -> Iterator[None]:
    """Torch elastic's own log lines go to the job folder, not to the user's terminal."""
    logger = logging.getLogger("torch.distributed")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handlers, propagate = logger.handlers, logger.propagate
    logger.handlers, logger.propagate = [handler], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        handler.close()


def now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)  # stored as naive UTC


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _slurm_job_id() -> str | None:
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID")
