"""Consecutive runs of a sweep in one torchrun job, on warm workers (launch.reuse_workers=true).

A torchrun job costs seconds before its experiment starts (the agent, the rendezvous, torch imported in
every worker: about 8 s on a loaded 2-core machine), more than a tiny run's experiment itself. A batch
is consecutive configs that one job's workers can run one after the other (`batch_key`): its workers
(`python -m tpbench.run.worker --batch BATCH_DIR`) loop over the batch's job folders, each run as a fresh
worker would run it (tpbench.run.worker says how), and rank 0 marks each run done as its results are in.
The parent (`run_batch`) runs torchrun's agent in a thread of its own and yields each run's Outcome as
its done mark appears, so the sweep records it then, while the workers go on to the next.

A failing run ends the job as it ends a job of its own (an exception, an OOM, a killed rank, a
collective timeout, SIGALRM past its launch.job_timeout_s): its Outcome is what `tpbench.run.launch` makes
of that job's failure, with the run's own log files; the runs after it start again in a fresh job.
Ctrl-C (SIGINT, or SIGTERM, SIGHUP, SIGQUIT) stops the workers and ends the run in progress
INTERRUPTED, as the agent does for a job of its own.

What never shares a job, each run alone as before: fault injection (`fault=`: it kills, hangs or floods
workers on purpose), train.compile (Dynamo's caches live in the process), a memory cap (an address-space
limit a worker sets after joining its first process group, which a warm worker would re-join under),
a real GPU (its caching allocator and cuBLAS workspaces outlive a run: a reserved peak would depend on
the run before), several nodes, and Slurm.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType

from torch.distributed.launcher.api import elastic_launch

from tpbench.config import RunConfig, local_world_size, world_size
from tpbench.parallel import emulation
from tpbench.results import Environment, Outcome, Status
from tpbench.run import launch, worker

POLL_S = 0.02  # how often the parent looks for a run's done mark


def batch_key(cfg: RunConfig) -> tuple | None:
    """What the runs of one batch share: the workers' number and place, device, backend and
    emulation. None: the run runs alone (see the module docstring for why each)."""
    lc = cfg.launch
    alone = (
        not lc.reuse_workers
        or lc.launcher != "local"
        or int(lc.nnodes) != 1
        or cfg.fault
        or cfg.train.compile
        or lc.memory_cap_mb
        or (lc.device == "cuda" and not emulation.gpu_emulated(cfg))
    )
    if alone:
        return None
    return world_size(cfg), local_world_size(cfg), lc.device, lc.backend, lc.emulate, lc.rdzv_endpoint


def batches(configs: Sequence[RunConfig]) -> Iterator[list[RunConfig]]:
    """The configs in order, consecutive ones with the same batch_key together; a run that runs alone
    is a batch of one."""
    group: list[RunConfig] = []
    for cfg in configs:
        key = batch_key(cfg)
        if group and (key is None or key != batch_key(group[0])):
            yield group
            group = []
        group.append(cfg)
        if key is None:
            yield group
            group = []
    if group:
        yield group


def run_batch(
    configs: Sequence[RunConfig], on_start: Callable[[RunConfig], Callable[[str], None]]
) -> Iterator[tuple[RunConfig, Outcome]]:
    """Run a batch (configs of one batch_key) on warm workers, yielding each run's Outcome as it ends;
    after a run that ended its job, the rest in a fresh job; an interrupted run is the last.
    `on_start(cfg)` is called as a run starts and returns what takes its progress lines."""
    rest = list(configs)
    while rest:
        job = _Job(rest)
        try:
            job.start()
            for cfg, job_dir in zip(list(rest), job.jobs, strict=True):
                ended = job.wait(cfg, job_dir, on_start(cfg))
                job_ended = not job.thread.is_alive() and job.failure is not None
                if job_ended and ended.status is not Status.INTERRUPTED and _alone(rest):
                    shutil.rmtree(job_dir, ignore_errors=True)
                    break  # a group validated beside one dense model ended the job: each alone now
                rest.pop(0)
                yield cfg, ended
                if ended.status is Status.INTERRUPTED:
                    return
                if job_ended:
                    break  # the job ended with this run: the rest in a fresh one
        finally:
            job.close()


def _alone(rest: list[RunConfig]) -> bool:
    """When the job ended during the first of `rest`: whether it was the first of a group of validate
    runs beside one dense model (tpbench.run.worker), which the workers ran as one, so that the
    failure may be any one's. If so, the group's runs are set to run each alone
    (launch.share_dense=1), and the failure is then its own run's."""
    from tpbench.experiments.dense_side import count_beside

    count = count_beside(rest, 0)
    if count == 1:
        return False
    for i in range(count):
        rest[i] = dataclasses.replace(rest[i], launch=dataclasses.replace(rest[i].launch, share_dense=1))
    return True


class _Job:
    """One torchrun job running several runs: its agent in a thread, its runs' job folders. While it
    runs, a signal the agent would trap (Ctrl-C's SIGINT, SIGTERM, SIGHUP, SIGQUIT) stops the workers
    and ends the run in progress INTERRUPTED, whatever the main thread is doing then (recording the run
    before, say)."""

    def __init__(self, configs: Sequence[RunConfig]):
        self.folder = Path(tempfile.mkdtemp(prefix="tpbench-batch-"))
        self.jobs = [launch.new_job(cfg) for cfg in configs]
        (self.folder / "jobs").write_text("".join(f"{job}\n" for job in self.jobs))
        self.env: Environment = launch.probe(configs[0])  # the runs share node, device and backend
        self.load = launch.load_before()  # the machine's before the job: its runs' throughput is timed on it
        self.first = configs[0]
        self.failure: BaseException | None = None
        self.interrupted: signal.Signals | None = None
        self.told = False  # whether a run was ended INTERRUPTED by self.interrupted
        self.handlers: dict[int, object] = {}
        self.last_end = launch.now()
        self.thread = threading.Thread(target=self._agent, daemon=True)

    def start(self) -> None:
        self.handlers = {sig: signal.getsignal(sig) for sig in launch.AGENT_SIGNALS}
        for sig in launch.AGENT_SIGNALS:
            signal.signal(sig, self._on_signal)
        self.thread.start()

    def _agent(self) -> None:
        try:
            with launch.agent_log(self.folder / "launcher.log"):
                agent = elastic_launch(launch.launch_config(self.first, self.folder), sys.executable)
                agent("-m", "tpbench.run.worker", "--batch", str(self.folder))
        except BaseException as e:  # handed to the main thread, which names the run it ended
            self.failure = e

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted is None:
            self.interrupted = signal.Signals(signum)
            self._kill_workers()

    def wait(self, cfg: RunConfig, job_dir: Path, on_progress: Callable[[str], None]) -> Outcome:
        """The Outcome of the run of `job_dir`, once its done mark appears or the job ends."""
        started = self.last_end
        done = job_dir / worker.DONE
        with launch.Tail(job_dir / "logs", on_progress):
            while not done.exists() and self.thread.is_alive() and self.interrupted is None:
                self.thread.join(POLL_S)
        try:
            ended = launch.judged(cfg, job_dir) if done.exists() else self._failed(cfg, job_dir)
        except launch.JobFailed as e:
            ended = e.status, e.message, e.rank, []
        ran = launch.outcome(cfg, job_dir, self.env, started, ended, load=self.load)
        self.last_end = ran.ended_at  # the next run's start
        return ran

    def _failed(self, cfg: RunConfig, job_dir: Path) -> tuple:
        """The job ended (or is stopped) before this run was done: what its failure says, with the
        agent's log and the ranks' error files copied into the run's job folder beside its own logs."""
        if self.interrupted is not None:
            self.thread.join()
            self.told = True
            raise launch.JobFailed(Status.INTERRUPTED, f"interrupted by {self.interrupted.name}")
        shutil.copy(self.folder / "launcher.log", job_dir / "launcher.log")
        for error in self.folder.glob("logs/*/attempt_0/*/error.json"):
            logs = job_dir / worker.BATCH_LOGS / error.parent.name
            logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(error, logs / "error.json")
        if self.failure is None:  # every worker ended well, yet without this run: cannot be
            raise launch.JobFailed(Status.FAILED, "rank 0 ended the batch without this run's results", 0)
        raise launch.failure_of(self.failure, cfg, job_dir)

    def _kill_workers(self) -> None:
        for job_dir in self.jobs:
            for pid_file in (job_dir / "pids").glob("rank*.pid"):
                _kill_if_ours(int(pid_file.read_text()), self.folder)

    def close(self) -> None:
        """Stop what still runs; remove the folders of runs that never ran, and the batch's own. A
        signal that came after the last run ended is raised again, now that its handler is back."""
        self._kill_workers()
        if self.thread.is_alive():
            self.thread.join()
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        for job_dir in self.jobs:
            if not (job_dir / "pids" / "rank0.pid").exists():
                shutil.rmtree(job_dir, ignore_errors=True)
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.interrupted is not None and not self.told:
            signal.raise_signal(self.interrupted)


def _kill_if_ours(pid: int, folder: Path) -> None:
    """SIGKILL a worker of the batch in `folder`, if that pid is still one."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if str(folder).encode() in cmdline:
        os.kill(pid, signal.SIGKILL)
