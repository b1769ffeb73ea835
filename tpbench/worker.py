"""One rank of a tpbench job: `python -m tpbench.worker JOB_DIR`, started by the launcher's agent.

Reads the resolved config from JOB_DIR/config.yaml (never from argv), joins the process group, runs the
experiment and hands its RankResult to rank 0, which writes every rank's result to JOB_DIR/results/
(so a multi-node job ends with all results on the node of rank 0). An exception reaches the launcher
through torch elastic's error file (`@record`).
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import resource
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from tpbench import emulation, faults, machine
from tpbench.config import RunConfig, load_run_config
from tpbench.experiments import experiment
from tpbench.results import RankResult

PR_SET_PDEATHSIG = 1


@record
def main(job_dir: Path) -> None:
    cfg = load_run_config(str(job_dir / "config.yaml"))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    _register(job_dir, rank)
    signal.alarm(math.ceil(cfg.launch.job_timeout_s))  # SIGALRM ends the process: the run is TIMEOUT
    device = _device(cfg, local_rank)
    machine.write_rank_device(job_dir, rank, machine.rank_device_name(cfg, device))
    if emulation.emulated(cfg):  # this one process is rank r of the whole job, on the fake backend
        emulation.init_process_group(cfg)
    else:
        dist.init_process_group(
            cfg.launch.backend,
            timeout=timedelta(seconds=cfg.launch.collective_timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    _cap_memory(cfg, device)
    faults.before_experiment(cfg, rank, device)
    run = experiment(cfg.kind)
    # what the imports made lives as long as the process: moved out of the cycle collector's way, a
    # collection (memory.run's before its measured steps) scans only what the run made, in ms not 0.2 s
    gc.freeze()
    result = run(cfg)
    faults.after_experiment(cfg, result)
    if emulation.emulated(cfg):
        (job_dir / "results").mkdir(exist_ok=True)
        result.save(job_dir / "results")
    else:
        _hand_in(result, job_dir / "results")
    dist.destroy_process_group()


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
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the ranks of this node
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    return torch.device("cpu")


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


if __name__ == "__main__":
    main(Path(sys.argv[1]))
