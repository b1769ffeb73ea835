"""How long a run will take here, said before it launches: the FLOPs it executes over a measured rate.

A run's time is about the FLOPs of the matmuls its busiest rank executes, divided by this machine's
matmul rate in the dtype they run in, plus the launch's fixed cost (torchrun's start and every worker's
imports). The FLOPs are the analytic model's (tpbench.predict.theory), counted for what each kind really runs:

  validate    the dense model on the global batch, the sharded model's share of it and, off fp32, the
              dense model in fp32 (the reference), for 1 + validate.steps steps, and the forwards that
              compare their logits every validate.every steps
  memory      max(train.warmup, the steps to a steady state) + train.steps steps of the busiest rank
  throughput  train.warmup + 2 (the counted and the FLOP-counted step) + train.steps steps

A rank's share of a step is its matmuls at its local sizes (heads and MLP columns divided by tp, the
LM head too under VP, its DP slice of the batch), plus what full recompute adds; the rest of a step
(norms, softmax, SwiGLU, AdamW) is STEP_OVERHEAD on top, as measured. `launch.emulate=fake` runs no
arithmetic: the launch alone.

The rate (`rate`) is timed on a square matmul in the setting a worker of the run gets (on the CPU its
threads: the cores shared by the ranks of the node, or OMP_NUM_THREADS), measured once per device
name, torch version, thread count and dtype within PROBE_BUDGET_S, and cached in
$TPBENCH_CACHE_DIR/rates.json (default ~/.cache/tpbench). An entry that does not parse or does not
match is measured again, never trusted.

Where it holds: a machine the run has to itself, and models whose matmuls dominate the step (H >= 256
or so, fp32 or bf16: within ~25% of the compute measured, docs/usage.md, "Estimates and progress"). The
tiny model's steps are mostly Python and small ops, which FLOPs do not count: its estimate is the
launch's cost, and its compute a lower bound.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from tpbench import machine
from tpbench.config import RunConfig, local_world_size, run_label
from tpbench.experiments.memory import steady_after
from tpbench.models.minimind import DTYPES
from tpbench.parallel import emulation
from tpbench.predict import theory

PROBE = "matmul, CPU time"  # how a rate is measured: a figure measured otherwise is measured again
PROBE_BUDGET_S = 0.5  # the most one rate's measurement may cost (CPU time on the CPU)
PROBE_SIZES = (128, 256, 512, 1024, 2048)  # square matmuls, the largest timed within the budget
STEADY_S = 0.05  # one matmul this long is a steady figure: no larger size is timed
# torchrun's start, a worker's imports of torch and tpbench, the process group and the results: the
# tiny validate run (0.03 s of matmuls) took 12.1 s on the idle 2-core Intel Xeon, 0.5 s of it its steps
LAUNCH_S = 11.0
# a run on the warm workers of the run before it (launch.reuse_workers, tpbench.run.batch): its own process
# group, model and results. The default tpbench run's memory and throughput runs, after its validate
# run on the same workers: 0.6 s and 0.5 s from start to end on the idle 2-core Intel Xeon
WARM_RUN_S = 0.5
# A training step's time over its matmuls' at the probe's rate: the rest of a step (attention's
# softmax, norms, SwiGLU, the loss, AdamW) and matmul shapes less efficient than the square probe.
# Measured here, one CPU thread, a dense step of the seed's shape (H 768, L 2, S 256-512, B 2) and of
# MiniMind's: fp32 1.7-2.0, bf16 1.16; 1.6 keeps both within 25%.
STEP_OVERHEAD = 1.6
LONG_RUN_S = 60.0  # above this, a run gets a "long run" line
# A 16-bit kernel, where there is one, is at least as fast as fp32's (half the bytes; AVX512-BF16 and
# AMX or tensor cores many times faster): below half of fp32's rate the dtype is emulated.
SLOW_KERNEL_RATIO = 0.5
# the CPU flags of a fast 16-bit matmul, as /proc/cpuinfo names them
FAST_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class Estimate:
    """A run's expected wall time: FLOPs of the busiest rank by the dtype they run in, over the rates."""

    cfg: RunConfig
    flops: dict[str, float]  # dtype -> FLOPs of the busiest rank
    rates: dict[str, float]  # dtype -> this machine's matmul FLOP/s for a worker of the run
    threads: int | None  # CPU threads of a worker (None on a GPU)
    warm: bool = False  # runs on the warm workers of the run before it: no launch of its own

    @property
    def launch_s(self) -> float:
        return WARM_RUN_S if self.warm else LAUNCH_S

    @property
    def compute_s(self) -> float:
        return STEP_OVERHEAD * sum(f / self.rates[dtype] for dtype, f in self.flops.items())

    @property
    def seconds(self) -> float:
        return self.launch_s + self.compute_s

    def line(self) -> str:
        """One line: the estimate and what it is made of."""
        where = (
            f"{self.threads} thread{'s' * (self.threads != 1)}" if self.threads else self.cfg.launch.device
        )
        parts = [
            f"{f / 1e9:,.3g} GFLOP in {dtype} at {self.rates[dtype] / 1e9:,.3g} GFLOP/s"
            for dtype, f in self.flops.items()
        ]
        work = " + ".join(parts) if parts else "no arithmetic (fake tensors)"
        return (
            f"estimate: {run_label(self.cfg)} {self.cfg.train.dtype}: ~{duration(self.seconds)} "
            f"({work} on the busiest rank, {where}, x {STEP_OVERHEAD:g} for the rest of a step; "
            + (
                f"+ {WARM_RUN_S:g} s on the run before's workers)"
                if self.warm
                else f"+ {LAUNCH_S:g} s to launch)"
            )
        )


def estimate(cfg: RunConfig) -> Estimate:
    """The estimate of one run on this machine, measuring a rate it has no cached figure for."""
    flops = executed_flops(cfg)
    threads = worker_threads(cfg)
    return Estimate(cfg, flops, {dtype: rate(dtype, cfg, threads) for dtype in flops}, threads)


def rank_step_flops(cfg: RunConfig) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward) on the busiest rank: its
    local heads, KV heads and MLP columns, its LM head (sharded under VP), its DP slice of the batch;
    and what full recompute adds to it. At tp = dp = 1 it is theory.model_flops_per_step."""
    d = theory.dims(cfg)
    weights = 2 * d.H * (2 * d.Hq + 2 * d.Hkv + 3 * d.I_l)  # per token and layer: q, o; k, v; MLP
    attention = 2 * 2 * d.S * d.Hq  # per token and layer: Q K^T and P V over the full S x S
    forward = d.N * (d.L * (weights + attention) + 2 * d.H * d.V_l)
    return 3.0 * forward + theory.recompute_flops_per_step(cfg) / (d.T * d.dp)


def executed_flops(cfg: RunConfig) -> dict[str, float]:
    """FLOPs the busiest rank of the run executes, by the dtype its matmuls run in (the module's
    docstring says what each kind runs); none under fake-tensor emulation."""
    if cfg.launch.emulate == "fake":
        return {}
    t, dtype = cfg.train, cfg.train.dtype
    share = rank_step_flops(cfg)
    if cfg.kind == "memory":
        return {dtype: share * (max(t.warmup, steady_after(cfg)) + t.steps)}
    if cfg.kind == "throughput":
        return {dtype: share * (t.warmup + 2 + t.steps)}
    v = cfg.validate
    steps = 1 + v.steps  # the counted forward and backward, then the AdamW steps
    compared = sum(1 for s in range(1, v.steps + 1) if s % v.every == 0 or s == v.steps)
    dense = theory.model_flops_per_step(cfg)  # the dense model runs the global batch on every rank
    flops = {dtype: (dense + share) * (steps + compared / 3)}  # a comparison: a forward of each
    if dtype != "float32":
        flops["float32"] = dense * steps
    return flops


def worker_threads(cfg: RunConfig) -> int | None:
    """The CPU threads a worker of the run computes with (tpbench.run.worker): OMP_NUM_THREADS where it
    is set, else the node's cores shared by its ranks; None for a GPU (not one emulated on the CPU)."""
    if cfg.launch.device == "cuda" and not emulation.gpu_emulated(cfg):
        return None
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdecimal() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // local_world_size(cfg))


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
    call = f"estimate.probe(torch.{dtype}, torch.device({device!r}), None)"
    code = f"import torch; from tpbench.sizing import estimate; print({call})"
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


def duration(seconds: float) -> str:
    """12 s, 3.5 min, 2.1 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


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
