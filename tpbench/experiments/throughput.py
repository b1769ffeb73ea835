"""Step time and tokens/s of training steps after warm-up; FLOPs counted and MFU on GPUs.

A step's time is that of the slowest rank: on the wall clock barrier to barrier, each step between
barriers; on NCCL the timed steps run back to back between one synchronise and barrier at each end,
a step the slowest rank's time between CUDA events on its compute stream, beside the host's time to
issue it (`step_issue_s`) and `host_bound` (that >= 90% of the step), and the batches are on the
GPU before the window (tpbench.parallel.timing says what each number means where). The
first warm-up step is reported apart (`first_step_s`: it includes torch.compile's compiling); the step
time is the median over train.steps after train.warmup steps. Every collective of our engine and
DDP's buckets is timed in those steps, averaged over them: its total time (from when its group could
start it: tpbench.parallel.timing) and the part waited on (exposed), so `comm_hidden_fraction` is how
much of it parallel.overlap (or DDP) hid behind compute. (The dtensor engine's collectives are counted
on a step of its own: the counting mode would slow the timed ones.) The metric `timing_cuda_events`
says how: 1 CUDA events, 0 the host's wall clock.

Beside them, rank 0 records the time model's prediction of the same step (tpbench.predict.steptime:
`predicted_step_time_s`, its compute, exposed communication by purpose and optimizer, tokens/s, MFU).
Under gradient accumulation (train.accumulation = K) a step is K micro-batches: its tokens and model
FLOPs are K micro-batches' (the time model's prediction, one micro-batch's, is not recorded there).

Model FLOPs come from the analytic model; the FLOPs every rank really executes are counted on one
step and summed over ranks (replicated work under TP counts on every rank), by `LocalFlopCounter`:
torch's FlopCounterMode with the formula of the CPU SDPA kernel added (torch has none, so attention
counted zero on CPU), counting what runs on each rank's local tensors, so that a DTensor op counts its
local shards as our engine's ops do, not the global shape on every rank.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import (
    FlopCounterMode,
    _FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from tpbench.config import RunConfig, local_batch
from tpbench.experiments.progress import StepProgress
from tpbench.experiments.setup import counting
from tpbench.experiments.training import Trainer
from tpbench.parallel import collectives, instrumentation, timing
from tpbench.predict import hardware, steptime, theory
from tpbench.results import RankResult


def run(cfg: RunConfig) -> RankResult:
    trainer = Trainer(cfg)
    result = RankResult(rank=trainer.ctx.rank)
    device, backend = trainer.ctx.device, dist.get_backend()
    clock = timing.step_clock(device, backend)
    result.add("timing_cuda_events", clock.method == timing.CUDA_EVENTS)
    timed_comm = cfg.parallel.engine in ("megatron", "ddp")  # DTensor's collectives: counted, not timed
    progress = StepProgress("throughput", cfg.train.warmup + 1 + (not timed_comm) + cfg.train.steps)
    for i in range(cfg.train.warmup):
        if i == 0:  # with train.compile: compiling, apart from the step times below
            result.add("first_step_s", _slowest(clock, [_timed_step(clock, trainer)])[0], "s")
        else:
            trainer.step()
        progress.step()

    counter = instrumentation.CommCounter(timed=timed_comm, timer=timing.collective_timer(device, backend))
    if not timed_comm:  # on a step of its own: DTensor's counting mode slows compute
        with counting(cfg, counter):
            trainer.step()
        progress.step()
        result.comm = counter.rows()
    flops = LocalFlopCounter()
    # eager under train.compile: a dispatch mode cannot run inside a compiled graph (its matmuls are
    # the same)
    with torch.compiler.set_stance("force_eager"), flops:
        trainer.step()
    progress.step()
    result.add("flops_per_step", _summed_over_ranks(flops.get_total_flops()), "FLOP")

    trainer.batches.prefetch(cfg.train.steps)  # on the GPU before the timed window
    cpu_start = time.process_time()
    timed = timed_steps(clock, trainer, cfg.train.steps, counter if timed_comm else None, progress.step)
    # this rank's CPU time per step, its threads' (gloo's included): on a loaded CPU, the work without
    # the waiting for cores that the wall clock adds
    result.add("step_cpu_time_s", (time.process_time() - cpu_start) / cfg.train.steps, "s")
    if timed_comm:
        result.comm = counter.rows(steps=cfg.train.steps)  # per step, averaged over the timed steps
        total, exposed = (sum(getattr(r, f) for r in result.comm) for f in ("time_s", "exposed_s"))
        result.add("comm_time_s", total, "s")
        result.add("comm_exposed_s", exposed, "s")
        if total > 0:
            result.add("comm_hidden_fraction", 1 - exposed / total)
    result.add("comm_bytes_per_step", sum(r.bytes for r in result.comm), "B")
    times = _slowest(clock, timed.device)
    median = statistics.median(times)
    if timed.issue:  # CUDA events: the host's time to enqueue a step, the slowest rank's
        issue = statistics.median(_slowest(clock, timed.issue))
        result.add("step_issue_s", issue, "s")
        result.add("host_bound", float(timing.host_bound(issue, median)))
    world = cfg.parallel.dp * cfg.parallel.tp
    k = cfg.train.accumulation  # a step's micro-batches: its tokens and FLOPs are all of theirs
    tokens = local_batch(cfg) * cfg.parallel.dp * k * cfg.train.seq_len
    result.add("tokens_per_step", tokens, "tokens")  # the batch policy's: equal across modes at fixed_global
    result.add("step_time_s", median, "s")
    if cfg.train.grad_clip:  # train.grad_clip_nonfinite=skip: the optimizer steps a non-finite norm skipped
        result.add("grad_clip_skipped_steps", float(trainer.skipped_steps))
    result.add("step_time_p10_s", _quantile(times, 0.1), "s")
    result.add("step_time_p90_s", _quantile(times, 0.9), "s")
    result.add("tokens_per_s", tokens / median, "tokens/s")
    result.add("tokens_per_s_per_device", tokens / median / world, "tokens/s")
    model_flops = theory.model_flops_per_step(cfg) * k
    result.add("model_flops_per_step", model_flops, "FLOP")
    result.add("predicted_recompute_flops_per_step", theory.recompute_flops_per_step(cfg) * k, "FLOP")
    result.add("predicted_comm_bytes_per_step", theory.predict(cfg).comm_bytes_per_step, "B")
    peak = None
    if trainer.ctx.device.type == "cuda":
        tf32 = torch.backends.cuda.matmul.allow_tf32  # fp32 matmuls on the tensor cores
        peak = peak_flops(torch.cuda.get_device_name(trainer.ctx.device), cfg.train.dtype, tf32)
    if peak:
        result.add("mfu", model_flops / median / (world * peak))
    # after the timed steps: a rate not cached yet is probed here. The time model's step is one
    # micro-batch's: under accumulation (k > 1) `tpbench fit` composes it, a run predicts none
    if trainer.ctx.rank == 0 and k == 1:
        for name, value in predicted_time(cfg, device).fields().items():
            unit = "" if name == "predicted_mfu" else "tokens/s" if "tokens" in name else "s"
            result.add(name, value, unit)
    return result


def predicted_time(cfg: RunConfig, device: torch.device) -> steptime.TimePrediction:
    """The time model's step (tpbench.predict.steptime) at this device's rates: a GPU's from the
    hardware table (by its device name), the CPU's probed with this worker's threads."""
    if device.type == "cuda":
        row = hardware.of_device(torch.cuda.get_device_name(device))
        return steptime.predict_time(cfg, steptime.rates_for(cfg, row.name if row else None))
    return steptime.predict_time(cfg, steptime.cpu_rates(cfg, torch.get_num_threads()))


def _timed_step(clock: timing.StepClock, trainer: Trainer) -> float:
    return clock.time(trainer.step, trainer.sync)


def timed_steps(
    clock: timing.StepClock,
    trainer: Trainer,
    steps: int,
    counter: instrumentation.CommCounter | None,
    after_each=lambda: None,
) -> timing.StepTimes:
    """This rank's time of each of `steps` steps (and, on CUDA, the host's time to issue each), as
    `clock.steps` times them; with `counter`, every collective of them counted and timed into it (its
    rows(steps) then the average step's). `after_each` runs after each step, outside its time."""
    with instrumentation.counting(counter) if counter is not None else contextlib.nullcontext():
        times = clock.steps(trainer.step, trainer.sync, steps, after_each)
        # ZeRO-1: the last step's all-gathers, which the next forward would wait for, waited here so
        # that their times are reported with the window's (outside every step's time)
        wait = getattr(getattr(trainer, "model", None), "wait_params", None)
        if wait is not None:
            wait()
        return times


def _slowest(clock: timing.StepClock, times: list[float]) -> list[float]:
    """Each step's time on the slowest rank: CUDA events time each rank's own step (barrier to
    barrier on the wall clock is already the slowest's)."""
    if clock.method == timing.CUDA_EVENTS:
        return collectives.reduce_floats(times, dist.ReduceOp.MAX)
    return times


def _summed_over_ranks(value: float) -> float:
    """Every rank's count summed over the job, on a tensor of the device the backend serves."""
    return collectives.reduce_floats([float(value)])[0]


def _sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:  # shapes, as torch passes them
    return sdpa_flop_count(query, key, value)


def _sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


class _LocalFlopCounterMode(_FlopCounterMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs it; the ops on its local shards come back here
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **(kwargs or {}))  # DTensor's sharding propagation: nothing runs
        return super().__torch_dispatch__(func, types, args, kwargs)


class LocalFlopCounter(FlopCounterMode):
    """FlopCounterMode over the ops each rank runs on its own tensors, CPU attention included."""

    def __init__(self) -> None:
        aten = torch.ops.aten
        cpu_sdpa = {  # the formulas torch gives its CUDA SDPA kernels (q, k, v shapes: full S x S)
            aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
        }
        super().__init__(display=False, custom_mapping=cpu_sdpa)

    def __enter__(self) -> LocalFlopCounter:
        super().__enter__()
        self.mode.__exit__(None, None, None)  # swap torch's dispatch mode for the local one
        self.mode = _LocalFlopCounterMode(self)
        self.mode.__enter__()
        return self


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def peak_flops(device_name: str, dtype: str, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of one GPU for matmuls in `dtype` (train.dtype: mixed precision runs its
    matmuls in it too), or None for a GPU not in tpbench.predict.hardware's table."""
    gpu = hardware.of_device(device_name)
    return None if gpu is None else gpu.peak_flops(dtype, tf32)
