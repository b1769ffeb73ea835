"""One rank of a tpbench job, started by the launcher's agent: `python -m tpbench.run.worker JOB_DIR`
runs one run, `python -m tpbench.run.worker --batch BATCH_DIR` the runs of a batch (tpbench.run.batch)
one after the other, in this one process.

Reads each run's resolved config from its job folder's config.yaml (never from argv), joins the process
group, runs the experiment and hands its RankResult to rank 0, which writes every rank's result to the
job folder's results/ (so a multi-node job ends with all results on the node of rank 0). An exception
reaches the launcher through torch elastic's error file (`@record`).

A batch's worker runs each run as a fresh worker would: its own process group (on a store prefix of its
own, the keys of the run before untouched), its own job timeout, its stdout and stderr in the run's own
log files, the global RNG as a fresh process has it, the cycle collector's leftovers collected; rank 0
marks the run done (JOB_DIR/done) once every rank's result is written, and no rank starts the next run
before that.

An overlap run on CUDA (parallel.overlap=true, launch.device=cuda, a real GPU) sets
CUDA_DEVICE_MAX_CONNECTIONS=1 in its workers before CUDA starts, as Megatron does: with one hardware
queue the GPU runs kernels in the order they were launched, so a collective launched before the GEMM
it should hide behind is not queued behind it. The run records the value it ran under (the metric
`cuda_device_max_connections`, from rank 0's result like every metric). CUDA runs always start fresh
workers (tpbench.run.batch), so no run inherits another's setting.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
import resource
import signal
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from tpbench.run import collector

with collector.paused():  # torch's import, a third quicker (tpbench.run.collector)
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    from tpbench import machine
    from tpbench.config import RunConfig, load_run_config
    from tpbench.experiments import experiment
    from tpbench.parallel import context, emulation
    from tpbench.results import RankResult
    from tpbench.run import faults

PR_SET_PDEATHSIG = 1
DONE = "done"  # in a batch, rank 0 writes it into the job folder once the run's results are all there
BATCH_LOGS = "logs/batch/attempt_0"  # a batched run's per-rank logs, laid out as torch elastic's


@record
def main(job_dir: Path) -> None:
    cfg = load_run_config(str(job_dir / "config.yaml"))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    _register(job_dir, rank)
    signal.alarm(math.ceil(cfg.launch.job_timeout_s))  # SIGALRM ends the process: the run is TIMEOUT
    os.environ.update(worker_env(cfg))  # before CUDA starts: read when its context is made
    device = _device(cfg, local_rank)
    machine.write_rank_device(job_dir, rank, machine.rank_device_name(cfg, device))
    _init_group(cfg, device)
    _cap_memory(cfg, device)
    _run(cfg, job_dir, rank, device)


@record
def main_batch(batch_dir: Path) -> None:
    """Each job folder listed in BATCH_DIR/jobs, in order: runs the launcher found compatible
    (tpbench.run.batch.batch_key), so that one process setup fits them all. Consecutive validate runs
    with one dense side run as one, beside it (tpbench.experiments.dense_side.groups_beside)."""
    jobs = [Path(line) for line in (batch_dir / "jobs").read_text().splitlines()]
    configs = [load_run_config(str(job_dir / "config.yaml")) for job_dir in jobs]
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    fresh_rng = torch.get_rng_state()
    device = None
    from tpbench.experiments.dense_side import groups_beside

    for index, count in groups_beside(configs):
        cfgs, job_dirs = configs[index : index + count], jobs[index : index + count]
        with _logs_in(job_dirs[0], local_rank):
            for job_dir in job_dirs:
                _register(job_dir, rank)
            signal.alarm(math.ceil(sum(cfg.launch.job_timeout_s for cfg in cfgs)))
            device = device or _device(cfgs[0], local_rank)
            for job_dir in job_dirs:
                machine.write_rank_device(job_dir, rank, machine.rank_device_name(cfgs[0], device))
            _point_to_logs(job_dirs, local_rank)
            torch.set_rng_state(fresh_rng)
            gc.collect()  # what the run before left in cycles: gone, as in a fresh process
            _init_group(cfgs[0], device, store_prefix=f"tpbench-run-{index}")
            _run_beside(cfgs, job_dirs, rank, device)
            signal.alarm(0)


def _point_to_logs(job_dirs: list[Path], local_rank: int) -> None:
    """The runs validated beside the first write to its logs: each one's own log says where."""
    for job_dir in job_dirs[1:]:
        folder = job_dir / BATCH_LOGS / str(local_rank)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "stdout.log").write_text(
            f"validated beside {job_dirs[0].name}, one dense model for {len(job_dirs)} runs: "
            f"this run's lines are in {job_dirs[0] / BATCH_LOGS / str(local_rank)}\n"
        )


def _run_beside(cfgs: list[RunConfig], job_dirs: list[Path], rank: int, device: torch.device) -> None:
    """Validate runs beside one dense side (tpbench.experiments.validate.run_beside), each one's
    results handed in and its done mark written in order; one run: `_run`."""
    if len(cfgs) == 1:
        _run(cfgs[0], job_dirs[0], rank, device, done=job_dirs[0] / DONE)
        return
    from tpbench.experiments.validate import run_beside

    gc.freeze()
    for result, job_dir in zip(run_beside(cfgs), job_dirs, strict=True):
        _hand_in(result, job_dir / "results")
        if rank == 0:
            (job_dir / DONE).touch()
        dist.barrier()
    context.leave_world()


MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def worker_env(cfg: RunConfig) -> dict[str, str]:
    """What the run's workers set in their environment before CUDA starts (see the module docstring)."""
    real_cuda = cfg.launch.device == "cuda" and not emulation.gpu_emulated(cfg)
    return {MAX_CONNECTIONS: "1"} if real_cuda and cfg.parallel.overlap else {}


def _register(job_dir: Path, rank: int) -> None:
    """Die with the launcher, and leave a pid file for its final check."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    (job_dir / "pids" / f"rank{rank}.pid").write_text(str(os.getpid()))
    # The agent stops workers with SIGINT on Ctrl-C: end at once, as with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _device(cfg: RunConfig, local_rank: int) -> torch.device:
    if cfg.launch.device == "cuda" and not emulation.gpu_emulated(cfg):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    machine.keep_freed_memory()  # a step's buffers reused, not paged in afresh each step
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the ranks of this node
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    return torch.device("cpu")


def _init_group(cfg: RunConfig, device: torch.device, store_prefix: str = "") -> None:
    """Join the run's process group: the fake backend for an emulated rank; else launch.backend on
    torchrun's store, under `store_prefix` if given (a batch's runs each have their own)."""
    if emulation.emulated(cfg):  # this one process is rank r of the whole job, on the fake backend
        emulation.init_process_group(cfg)
        return
    timeout = timedelta(seconds=cfg.launch.collective_timeout_s)
    store = {}
    if store_prefix:
        base, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store = {"store": dist.PrefixStore(store_prefix, base), "rank": rank, "world_size": world}
    dist.init_process_group(
        cfg.launch.backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **store
    )


def _run(cfg: RunConfig, job_dir: Path, rank: int, device: torch.device, done: Path | None = None) -> None:
    """The experiment on this rank, its results handed in, the process group left; `done`: the
    file rank 0 writes once every rank's result is in, which every rank waits for."""
    faults.before_experiment(cfg, rank, device)
    with collector.paused():  # the experiment's modules (tpbench.run.collector)
        run = experiment(cfg.kind)
    # what the imports made lives as long as the process: moved out of the cycle collector's way, a
    # collection (memory.run's before its measured steps) scans only what the run made, in ms not 0.2 s
    gc.freeze()
    result = run(cfg)
    if device.type == "cuda" and MAX_CONNECTIONS in os.environ:
        result.add("cuda_device_max_connections", int(os.environ[MAX_CONNECTIONS]))
    faults.after_experiment(cfg, result)
    if emulation.emulated(cfg):
        (job_dir / "results").mkdir(exist_ok=True)
        result.save(job_dir / "results")
    else:
        _hand_in(result, job_dir / "results")
    del result
    if done is not None:
        if rank == 0:
            done.touch()
        dist.barrier()
    context.leave_world()


def _cap_memory(cfg: RunConfig, device: torch.device) -> None:
    """launch.memory_cap_mb: on CPU an address-space limit, on CUDA a share of the GPU's memory."""
    cap = cfg.launch.memory_cap_mb << 20
    if not cap:
        return
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    else:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _hand_in(result: RankResult, folder: Path) -> None:
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if gathered is not None:
        folder.mkdir(exist_ok=True)
        for rank_result in gathered:
            rank_result.save(folder)


@contextlib.contextmanager
def _logs_in(job_dir: Path, local_rank: int) -> Iterator[None]:
    """This process's stdout and stderr (the file descriptors: C++'s lines too) in the run's own log
    files while it runs, where its failure's "logs:" points; a failure's traceback too (@record prints
    it on the way out)."""
    folder = job_dir / BATCH_LOGS / str(local_rank)
    folder.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush(), sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        log = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, fd)
        os.close(log)
    yield
    sys.stdout.flush(), sys.stderr.flush()
    for fd, copy in saved.items():
        os.dup2(copy, fd)
        os.close(copy)


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        main_batch(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
    context.exit_now()
