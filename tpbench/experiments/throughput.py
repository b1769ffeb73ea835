"""Step time and tokens/s of training steps after warm-up; FLOPs counted and MFU on GPUs.

Each step starts and ends on a barrier (and a CUDA synchronize), so its time is that of the slowest
rank. Model FLOPs come from the analytic model; the FLOPs every rank really executes are counted on
one step and summed over ranks (replicated work under TP counts on every rank), by `LocalFlopCounter`:
torch's FlopCounterMode with the formula of the CPU SDPA kernel added (torch has none, so attention
counted zero on CPU), counting what runs on each rank's local tensors, so that a DTensor op counts its
local shards as our engine's ops do, not the global shape on every rank.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import (
    FlopCounterMode,
    _FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from tpbench import theory
from tpbench.config import RunConfig, local_batch
from tpbench.experiments.setup import counting
from tpbench.experiments.training import Trainer
from tpbench.parallel import comm
from tpbench.results import RankResult

# Dense peak FLOP/s by device name and dtype, from the vendors' data sheets.
PEAK_FLOPS = {
    ("H200", torch.bfloat16): 989e12,
    ("H100", torch.bfloat16): 989e12,
    ("A100", torch.bfloat16): 312e12,
    ("H200", torch.float32): 67e12,
    ("H100", torch.float32): 67e12,
    ("A100", torch.float32): 19.5e12,
}


def run(cfg: RunConfig) -> RankResult:
    trainer = Trainer(cfg)
    result = RankResult(rank=trainer.ctx.rank)
    for _ in range(cfg.train.warmup):
        trainer.step()

    counter = comm.CommCounter(timed=True)
    flops = LocalFlopCounter()
    with counting(cfg, counter), flops:
        trainer.step()
    result.comm = counter.rows()
    result.add("comm_bytes_per_step", sum(r.bytes for r in result.comm), "B")
    executed = torch.tensor([float(flops.get_total_flops())], dtype=torch.float64)
    dist.all_reduce(executed)
    result.add("flops_per_step", executed.item(), "FLOP")

    times = []
    for _ in range(cfg.train.steps):
        trainer.sync()
        start = time.perf_counter()
        trainer.step()
        trainer.sync()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    world = cfg.parallel.dp * cfg.parallel.tp
    tokens = local_batch(cfg) * cfg.parallel.dp * cfg.train.seq_len
    result.add("step_time_s", median, "s")
    result.add("step_time_p10_s", _quantile(times, 0.1), "s")
    result.add("step_time_p90_s", _quantile(times, 0.9), "s")
    result.add("tokens_per_s", tokens / median, "tokens/s")
    result.add("tokens_per_s_per_device", tokens / median / world, "tokens/s")
    model_flops = theory.model_flops_per_step(cfg)
    result.add("model_flops_per_step", model_flops, "FLOP")
    result.add("predicted_comm_bytes_per_step", theory.predict(cfg).comm_bytes_per_step, "B")
    peak = _peak_flops(trainer.ctx.device, cfg)
    if peak:
        result.add("mfu", model_flops / median / (world * peak))
    return result


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


def _peak_flops(device: torch.device, cfg: RunConfig) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    return next((v for (chip, dt), v in PEAK_FLOPS.items() if chip in name and dt == dtype), None)
