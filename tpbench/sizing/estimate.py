"""How long a run will take here, said before it launches: the FLOPs it executes over a measured rate.

A run's time is about the FLOPs of the matmuls its busiest rank executes, divided by this machine's
matmul rate in the dtype they run in (tpbench.predict.rate_probe), plus the launch's fixed cost
(torchrun's start and every worker's imports). The FLOPs are the analytic model's
(tpbench.predict.theory), counted for what each kind really runs:

  validate    the dense model on the global batch, the sharded model's share of it and, off fp32, the
              dense model in fp32 (the reference), for 1 + validate.steps steps, and the forwards that
              compare their logits every validate.every steps
  memory      max(train.warmup, the steps to a steady state) + train.steps steps of the busiest rank
  throughput  train.warmup + 1 (the FLOP-counted step) + train.steps steps, + 1 counted step for dtensor

A rank's share of a step is its matmuls at its local sizes (heads and MLP columns divided by tp, the
LM head too under VP, its DP slice of the batch), plus what full recompute adds; the rest of a step
(norms, softmax, SwiGLU, AdamW) is STEP_OVERHEAD on top, as measured. `launch.emulate=fake` runs no
arithmetic: the launch alone.

Where it holds: a machine the run has to itself, and models whose matmuls dominate the step (H >= 256
or so, fp32 or bf16: within ~25% of the compute measured, docs/usage.md, "Estimates and progress"). The
tiny model's steps are mostly Python and small ops, which FLOPs do not count: its estimate is the
launch's cost, and its compute a lower bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tpbench.config import RunConfig, local_world_size, run_label
from tpbench.experiments.memory import steady_after
from tpbench.parallel import emulation
from tpbench.predict import theory
from tpbench.predict.rate_probe import rate

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
        return {dtype: share * (t.warmup + 1 + (cfg.parallel.engine == "dtensor") + t.steps)}
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


def duration(seconds: float) -> str:
    """12 s, 3.5 min, 2.1 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
