"""The machine a run ran on: the device each rank sees, and the hardware key, part of a run's identity.

The key is one readable line, e.g. `NVIDIA H100 80GB HBM3 · 8 GPUs per node · 2 nodes` or
`AMD EPYC 9B14 · 2 CPU cores per node · 1 node · ranks emulated`; tpbench.db's docstring
says what goes into it and why. It is made by `key` alone, from what a run recorded (its device name
and count) and its config (nodes, emulation), so that the key a sweep checks before launching, the key
a run is recorded under and the key an older database's rows are labelled with on upgrade agree.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tpbench.config import RunConfig

NAMES = "devices"  # in the job folder: one file per rank of this node, the name of the device it saw
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc takes (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


def cache_dir() -> Path:
    """tpbench's caches on this machine (the probed rates, inductor's kernels): $TPBENCH_CACHE_DIR,
    default ~/.cache/tpbench."""
    return Path(os.environ.get("TPBENCH_CACHE_DIR") or Path.home() / ".cache" / "tpbench")


def use_inductor_cache() -> None:
    """Inductor's on-disk caches in $TPBENCH_CACHE_DIR/inductor unless TORCHINDUCTOR_CACHE_DIR names
    another; called before torch loads. Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to torch's
    default (/tmp/torchinductor_$USER) where it is unset, so a later setdefault does nothing: the CLI's
    estimate imports it, and a run's workers inherited that default from it, compiling into /tmp."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep what a CPU step frees for the next one, as a GPU's caching allocator
    does; True where it took (glibc), False elsewhere (another libc: left as it is).

    By default glibc serves a block over its mmap threshold (128 KiB, raised as blocks are freed, to
    32 MiB at most) with a fresh mapping, unmapped when freed, and hands the heap's free top over
    128 KiB back to the kernel: a step's activations, logits and gradients are then paged in and
    zeroed by the kernel afresh every step, at a cost no probe of a warm kernel sees and that differs
    from rank to rank (each rank's heap its own), so the ranks reach each collective apart. MiniMind
    H 256, L 4, S 256, T 2, fp32 on a 2-core EPYC: 5,800-6,600 page faults a step a rank and a
    median step of 205 ms by default; 160-600 and 184 ms with this (docs/results/time_model.md).
    Blocks over MMAP_THRESHOLD are still mapped afresh each time."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def key(device: str, device_name: str, device_count: int, nnodes: str, emulate: str = "none") -> str:
    """The hardware of a run: device name, devices per node, nodes, and whether its ranks were emulated.

    Args:
        device: launch.device as resolved (cuda or cpu).
        device_name: the GPU model, the CPU model, or for a GPU emulated on the CPU
            `H100 (emulated on <CPU model>)`.
        device_count: GPUs per node (CUDA), else CPU cores per node; 0 where it is not known (a Slurm
            job that ended before it said, tpbench.run.slurm).
        nnodes: launch.nnodes.
        emulate: launch.emulate (none, real or fake).
    """
    per_node = "GPU" if device == "cuda" and emulate != "fake" else "CPU core"
    per_node += "" if device_count == 1 else "s"
    nodes = f"{nnodes} node" + ("" if nnodes == "1" else "s")
    parts = [device_name, *([f"{device_count} {per_node} per node"] if device_count else []), nodes]
    if emulate != "none":  # which flavour, and which rank, is the config's (tpbench.parallel.emulation)
        parts.append("ranks emulated")
    return " · ".join(parts)


def of_config(cfg: RunConfig, device_name: str, device_count: int) -> str:
    """The key of a run of `cfg` on a device of that name and count."""
    launch = cfg.launch
    return key(launch.device, device_name, device_count, launch.nnodes, launch.emulate)


# A GPU torch can see has one of these: NVIDIA's driver, AMD's ROCm (torch.cuda too), WSL's GPU.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpus_here() -> int:
    """torch.cuda's GPU count, read after every check of tpbench.run.compose: a refusal prints before
    torch loads (1.6 s idle). On a machine with no GPU's device file it is 0 without loading torch
    (torch's own count once it is loaded), so that a command that launches nothing (a sweep whose every
    run is done) loads no torch there either."""
    if "torch" not in sys.modules and not any(Path(f).exists() for f in GPU_DEVICE_FILES):
        return 0
    import torch

    return torch.cuda.device_count()


def here(cfg: RunConfig) -> tuple[str, int]:
    """(device name, device count) of this node as `cfg` would use it, probed before any launch:
    device=cuda torch.cuda's first GPU and GPU count; device=cpu the CPU model and its cores; a GPU
    emulated on fake tensors (tpbench.parallel.emulation) the emulated GPU on this CPU."""
    if cfg.launch.device == "cuda" and cfg.launch.emulate != "fake":
        import torch

        return _gpu_name(0), torch.cuda.device_count()
    return rank_device_name(cfg, None), os.cpu_count() or 1


def here_key(cfg: RunConfig) -> str:
    """The key a run of `cfg` launched from this node would be recorded under."""
    return of_config(cfg, *here(cfg))


def rank_device_name(cfg: RunConfig, device: torch.device | None) -> str:
    """The name of the device a rank computes on (a worker calls it with its own device)."""
    if device is not None and device.type == "cuda":
        return _gpu_name(device.index or 0)
    if cfg.launch.device == "cuda" and cfg.launch.emulate == "fake":
        return f"{cfg.launch.emulate_gpu} (emulated on {cpu_name()})"
    return cpu_name()


def write_rank_device(job: Path, rank: int, name: str) -> None:
    folder = job / NAMES
    folder.mkdir(exist_ok=True)
    (folder / f"rank{rank}.txt").write_text(name)


def ranks_device_name(job: Path) -> str | None:
    """What the ranks of this node saw: one name, or `A + B` when they saw different devices; None
    when no rank got as far as saying."""
    names = sorted({p.read_text() for p in (job / NAMES).glob("rank*.txt")})
    return " + ".join(names) if names else None


@cache
def _gpu_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


@cache
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
