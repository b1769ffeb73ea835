"""How long a run will take here, said before it launches: the time model's step on this machine
(tpbench.predict.steptime: each op's roofline and fixed cost, each collective's alpha and beta, at
the rates probed here and cached) times the steps the run executes, plus the launch's fixed cost
(torchrun's start and every worker's imports).

  validate    the sharded model's step and the dense model's on the global batch (one rank of it: every
              rank runs it) and the reference (the dense model in fp64 for an fp32 run: the fp32
              step at the fp64 matmul rate; else in fp32), for 1 + validate.steps steps, and the
              forwards that compare their logits every validate.every steps (a forward: a third of a
              step). Runs validated beside one dense side (launch.share_dense) are stepped in one
              process, in the first's time: it steps the dense side and every run's own model, the
              others are estimated at ~0 s (`share_dense_sides`)
  memory      max(train.warmup, the steps to a steady state) + train.steps steps
  throughput  train.warmup + 1 (the FLOP-counted step) + train.steps steps, + 1 counted step for dtensor

`launch.emulate=fake` runs no arithmetic: the launch alone. Where it holds, and how far it misses on
this machine's grid of throughput runs: docs/results/time_model.md. The matmul FLOPs of the busiest
rank (`rank_step_flops`) are said beside it, with their rate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from tpbench.config import RunConfig, local_batch, local_world_size, run_label
from tpbench.experiments import steady_after
from tpbench.parallel import emulation
from tpbench.predict import steptime, theory
from tpbench.predict.rate_probe import rate

# torchrun's start, a worker's imports of torch and tpbench, the process group and the results: the
# tiny validate run (0.03 s of matmuls) took 12.1 s on the idle 2-core Intel Xeon, 0.5 s of it its steps
LAUNCH_S = 11.0
# a run on the warm workers of the run before it (launch.reuse_workers, tpbench.run.batch): its own process
# group, model and results. The default tpbench run's memory and throughput runs, after its validate
# run on the same workers: 0.6 s and 0.5 s from start to end on the idle 2-core Intel Xeon
WARM_RUN_S = 0.5
LONG_RUN_S = 60.0  # above this, a run gets a "long run" line


@dataclass(frozen=True)
class Estimate:
    """A run's expected wall time: the time model's steps, and the matmul FLOPs of the busiest rank
    by the dtype they run in with their rates (said beside it)."""

    cfg: RunConfig
    flops: dict[str, float]  # dtype -> matmul FLOPs of the busiest rank
    rates: dict[str, float]  # dtype -> this machine's matmul FLOP/s for a worker of the run
    threads: int | None  # CPU threads of a worker (None on a GPU)
    warm: bool = False  # runs on the warm workers of the run before it: no launch of its own
    steps: dict[str, float] = field(default_factory=dict)  # what runs them -> steps executed
    step_s: dict[str, float] = field(default_factory=dict)  # what runs them -> the time model's step
    # validate runs beside one dense side (launch.share_dense) are stepped together, in the first's
    # time: the first carries the others' own steps (`beside_s`, `carries` runs); each other run is
    # `carried`: its results are written when the first's are
    beside_s: float = 0.0
    carries: int = 0
    carried: bool = False

    @property
    def launch_s(self) -> float:
        return 0.0 if self.carried else WARM_RUN_S if self.warm else LAUNCH_S

    @property
    def compute_s(self) -> float:
        return sum(self.step_s[k] * n for k, n in self.steps.items())

    @property
    def seconds(self) -> float:
        return 0.0 if self.carried else self.launch_s + self.compute_s + self.beside_s

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
        steps = ", ".join(f"{n:.3g} x {self.step_s[k]:.3g} s ({k})" for k, n in self.steps.items())
        if self.carries:
            steps += f", {self.beside_s:.3g} s ({self.carries} run{'s' * (self.carries != 1)} beside it)"
        model = f"time model: {steps}; " if steps else ""
        if self.carried:
            return (
                f"estimate: {run_label(self.cfg)} {self.cfg.train.dtype}: ~0 s (validated beside the "
                f"run before, in its time: {model}{work} on the busiest rank)"
            )
        return (
            f"estimate: {run_label(self.cfg)} {self.cfg.train.dtype}: ~{duration(self.seconds)} "
            f"({model}{work} on the busiest rank, {where}; "
            + (
                f"+ {WARM_RUN_S:g} s on the run before's workers)"
                if self.warm
                else f"+ {LAUNCH_S:g} s to launch)"
            )
        )


def estimate(cfg: RunConfig, beside: bool = False) -> Estimate:
    """The estimate of one run on this machine, measuring a rate it has no cached figure for;
    `beside`: validated beside the run before it, whose run steps the dense side."""
    flops = executed_flops(cfg, beside)
    threads = worker_threads(cfg)
    rates = {dtype: rate(dtype, cfg, threads) for dtype in flops}
    if cfg.launch.emulate == "fake":
        return Estimate(cfg, flops, rates, threads)
    steps = executed_steps(cfg, beside)
    models = {"step": cfg, "dense": dense(cfg), "fp32 reference": dense(cfg, "float32")}
    models["fp64 reference"] = models["fp32 reference"]  # its step at the fp64 rate, below
    ranks = local_world_size(cfg)  # every rank steps the dense side too: they share the cores
    rates_of = {k: steptime.rates_for(models[k], threads=threads, ranks=ranks) for k in steps}
    step_s = {k: steptime.predict_time(models[k], rates_of[k]).step_s for k in steps}
    if "fp64 reference" in step_s:  # the time model has no fp64: its fp32 step, slower as fp64's matmuls
        fp32, fp64 = (rate(dtype, cfg, threads) for dtype in ("float32", "float64"))
        step_s["fp64 reference"] *= fp32 / fp64
    return Estimate(cfg, flops, rates, threads, steps=steps, step_s=step_s)


def share_dense_sides(group: list[Estimate], beside: list[bool]) -> list[Estimate]:
    """The estimates of a batch's runs (`beside`: each validated beside the run before it, whose
    process steps them all, tpbench.run.worker): each group's first carries the others' own steps,
    the others take no time of their own."""
    out: list[Estimate] = []
    first = 0
    for e, b in zip(group, beside, strict=True):
        if b and out:
            f = out[first]
            out[first] = replace(f, beside_s=f.beside_s + e.compute_s, carries=f.carries + 1)
            e = replace(e, carried=True)
        else:
            first = len(out)
        out.append(e)
    return out


def executed_steps(cfg: RunConfig, beside: bool = False) -> dict[str, float]:
    """The steps a run executes, by what runs them: its own model's ("step"), and validate's dense
    model and reference (a comparison's forward a third of a step) unless `beside` a run before it."""
    t = cfg.train
    if cfg.kind == "memory":
        return {"step": max(t.warmup, steady_after(cfg)) + t.steps}
    if cfg.kind == "throughput":
        return {"step": t.warmup + 1 + (cfg.parallel.engine == "dtensor") + t.steps}
    v = cfg.validate
    compared = sum(1 for s in range(1, v.steps + 1) if s % v.every == 0 or s == v.steps)
    steps = {"step": 1 + v.steps + compared / 3}
    if not beside:
        steps["dense"] = 1 + v.steps + compared / 3
        steps["fp32 reference" if t.dtype != "float32" else "fp64 reference"] = 1 + v.steps
    return steps


def dense(cfg: RunConfig, dtype: str | None = None) -> RunConfig:
    """The dense model on the global batch, on one rank (validate's reference), in `dtype`."""
    par = replace(cfg.parallel, tp=1, dp=1, sp=False, vp=False, overlap=False, engine="megatron")
    train = replace(cfg.train, batch="fixed_per_rank", micro_batch=local_batch(cfg) * cfg.parallel.dp)
    if dtype is not None:
        train = replace(train, dtype=dtype, precision="pure")
    return replace(cfg, parallel=par, train=train)


def rank_step_flops(cfg: RunConfig) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward) on the busiest rank: its
    local heads, KV heads and MLP columns, its LM head (sharded under VP), its DP slice of the batch;
    and what full recompute adds to it. At tp = dp = 1 it is theory.model_flops_per_step."""
    d = theory.dims(cfg)
    weights = 2 * d.H * (2 * d.Hq + 2 * d.Hkv + 3 * d.I_l)  # per token and layer: q, o; k, v; MLP
    attention = 2 * 2 * d.S * d.Hq  # per token and layer: Q K^T and P V over the full S x S
    forward = d.N * (d.L * (weights + attention) + 2 * d.H * d.V_l)
    return 3.0 * forward + theory.recompute_flops_per_step(cfg) / (d.T * d.dp)


def executed_flops(cfg: RunConfig, beside: bool = False) -> dict[str, float]:
    """FLOPs the busiest rank of the run executes, by the dtype its matmuls run in (the module's
    docstring says what each kind runs; `beside`: validate's own model only); none under fake-tensor
    emulation."""
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
    gemms = "float32" if cfg.launch.bf16_gemm != "native" else dtype  # tpbench.models.gemm
    if beside:
        return {gemms: share * (steps + compared / 3)}
    flops = {gemms: (dense + share) * (steps + compared / 3)}  # a comparison: a forward of each
    reference = "float32" if dtype != "float32" else "float64"  # one precision up
    flops[reference] = flops.get(reference, 0.0) + dense * steps
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
