"""This machine's matmul rate in a dtype, for a worker of a run: measured by a probe, cached, and
compared with fp32's to tell a dtype with no fast kernel here (tpbench.sizing.estimate turns it
into a run's time).

The rate (`rate`) is timed on a square matmul in the setting a worker of the run gets (on the CPU its
threads: the cores shared by the ranks of the node, or OMP_NUM_THREADS), measured once per device
name, torch version, thread count and dtype within PROBE_BUDGET_S, and cached in
$TPBENCH_CACHE_DIR/rates.json (default ~/.cache/tpbench). An entry that does not parse or does not
match is measured again, never trusted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from tpbench import machine
from tpbench.config import RunConfig
from tpbench.models.minimind import DTYPES
from tpbench.parallel import emulation

PROBE = "matmul, CPU time"  # how a rate is measured: a figure measured otherwise is measured again
PROBE_BUDGET_S = 0.5  # the most one rate's measurement may cost (CPU time on the CPU)
PROBE_SIZES = (128, 256, 512, 1024, 2048)  # square matmuls, the largest timed within the budget
STEADY_S = 0.05  # one matmul this long is a steady figure: no larger size is timed

# A 16-bit kernel, where there is one, is at least as fast as fp32's (half the bytes; AVX512-BF16 and
# AMX or tensor cores many times faster): below half of fp32's rate the dtype is emulated.
SLOW_KERNEL_RATIO = 0.5
# the CPU flags of a fast 16-bit matmul, as /proc/cpuinfo names them
FAST_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def rate(dtype: str, cfg: RunConfig, threads: int | None) -> float:
    """This machine's matmul FLOP/s in `dtype` for a worker of `cfg`: cached, else measured and cached."""
    key = _key(dtype, cfg, threads)
    device = torch.device(str(key["device"]))
    entries = _read_cache()
    for entry in entries:
        if {k: entry.get(k) for k in key} == key and _valid_rate(entry.get("flops_per_s")):
            return float(entry["flops_per_s"])
    measured = probe(DTYPES[dtype], device, threads) if device.type == "cpu" else probe_in_child(dtype)
    kept = [e for e in entries if {k: e.get(k) for k in key} != key]
    now = datetime.now(UTC).isoformat(timespec="seconds")
    _write_cache([*kept, {**key, "flops_per_s": measured, "measured_at": now}])
    return measured


def probe(dtype: torch.dtype, device: torch.device, threads: int | None) -> float:
    """FLOP/s of a square matmul in `dtype` on `device` with `threads` CPU threads: the sizes of
    PROBE_SIZES in turn, each timed once warm, up to one that takes STEADY_S or the largest whose
    predicted cost fits in PROBE_BUDGET_S; the last size's figure. On the CPU the time is the
    process's CPU time over its threads, so that other processes on a busy machine do not slow the
    figure down (measured under a load of 33 on 2 cores: fp32 115-135 GFLOP/s by CPU time, 0.6-20 by
    the wall clock); on a GPU the wall clock between synchronizes."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    per = 1 if device.type == "cuda" else threads or saved
    try:
        spent, measured = 0.0, 0.0
        for n in PROBE_SIZES:
            flops = 2.0 * n**3
            if measured and spent + 2 * flops / measured > PROBE_BUDGET_S:  # a warm call and a timed one
                break
            start = clock()
            a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
            a @ b
            _sync(device)
            timed = clock()
            a @ b
            _sync(device)
            end = clock()
            spent += (end - start) / per
            seconds = max((end - timed) / per, 1e-9)
            measured = flops / seconds
            if seconds >= STEADY_S:
                break
        return measured
    finally:
        torch.set_num_threads(saved)


def probe_in_child(dtype: str, device: str = "cuda") -> float:
    """`probe` on `device` in a process of its own: a CUDA context made here would hold GPU 0's memory
    for as long as the command runs, beside rank 0's."""
    call = f"rate_probe.probe(torch.{dtype}, torch.device({device!r}), None)"
    code = f"import torch; from tpbench.predict import rate_probe; print({call})"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return float(done.stdout.split()[-1])


def slow_kernel_line(dtype: str, cfg: RunConfig, threads: int | None) -> str | None:
    """One line where `dtype`'s matmuls run far below fp32's here (emulated: no fast kernel), with the
    figures, the CPU flags that are missing and what to do instead; None where they do not."""
    if dtype == "float32":
        return None
    slow, fp32 = rate(dtype, cfg, threads), rate("float32", cfg, threads)
    if slow >= SLOW_KERNEL_RATIO * fp32:
        return None
    where = _device_name(cfg)
    missing = [flag for flag in FAST_FLAGS.get(dtype, ()) if flag not in _cpu_flags()]
    if missing and threads:
        where += f", whose /proc/cpuinfo has no {' nor '.join(missing)}"
    return (
        f"{dtype} has no fast matmul kernel here: {slow / 1e9:,.3g} GFLOP/s against float32's "
        f"{fp32 / 1e9:,.3g} ({where}); instead: dtype=float32 (the same run's matmuls "
        f"{fp32 / slow:,.0f}x faster), or launch.emulate=fake, whose memory peaks are byte-equal to a "
        "real run's and which runs no arithmetic"
    )


def cache_file() -> Path:
    folder = os.environ.get("TPBENCH_CACHE_DIR") or Path.home() / ".cache" / "tpbench"
    return Path(folder) / "rates.json"


def _key(dtype: str, cfg: RunConfig, threads: int | None) -> dict[str, object]:
    """What a measured rate is valid for."""
    device = "cuda" if threads is None else "cpu"
    return {
        "probe": PROBE,
        "device": device,
        "device_name": _device_name(cfg),
        "torch": torch.__version__,
        "threads": threads,
        "dtype": dtype,
    }


def _device_name(cfg: RunConfig) -> str:
    if cfg.launch.device == "cuda" and not emulation.gpu_emulated(cfg):
        return torch.cuda.get_device_name(0)
    return machine.cpu_name()


def _valid_rate(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _read_cache() -> list[dict]:
    """The cached entries; none where the file is missing, does not parse or is not tpbench's."""
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("rates") if isinstance(data, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _write_cache(entries: list[dict]) -> None:
    """Written whole and renamed into place: a run started at the same moment reads either file."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps({"rates": entries}, indent=1))
        partial.replace(path)
    except OSError:
        pass  # an unwritable cache: measured again next time


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
