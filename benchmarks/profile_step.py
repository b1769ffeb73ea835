"""Where a training step's time goes, by op: torch.profiler over measured steps of rank 0, after warm-up,
grouped as docs/results/speed.md reads them (the GEMMs, attention, our collectives' autograd
functions, the optimizer, the elementwise kernels, the rest: views, autograd's own work and Python),
beside the step time measured without the profiler and the time model's step by class.
Takes tpbench's overrides; run it as its job would run, one core per rank:
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/profile_step.py model=minimind layers=4 \\
      seq=512 micro_batch=2 dtype=float32 train.fused_optimizer=true tp=2"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from tpbench import machine
from tpbench.experiments.training import Trainer
from tpbench.predict import steptime
from tpbench.run.compose import expand

WARMUP, TIMED, PROFILED = 3, 5, 2
# op name -> group; the first group whose prefix matches, else "other"
GROUPS = {
    "aten::mm": "GEMMs (aten::mm)",
    "aten::_scaled_dot_product": "attention (SDPA)",
    "_CopyToTP": "collectives",
    "_ReduceFromTP": "collectives",
    "_GatherFromSP": "collectives",
    "_ReduceScatterToSP": "collectives",
    "_ScatterToSP": "collectives",
    "_GatherFromSPReplicated": "collectives",
    "c10d::": "collectives",
    "tpbench::": "collectives",  # compiled blocks call them as custom ops
    "aten::_fused_adamw": "optimizer",
    "aten::_foreach": "optimizer",
    "Optimizer.step": "optimizer",
    "aten::add": "elementwise",
    "aten::mul": "elementwise",
    "aten::pow": "elementwise",
    "aten::mean": "elementwise",
    "aten::rsqrt": "elementwise",
    "aten::silu": "elementwise",
    "aten::copy_": "elementwise",
    "aten::_to_copy": "elementwise",
    "aten::cat": "elementwise",
    "aten::neg": "elementwise",
    "aten::_log_softmax": "elementwise",
    "aten::nll_loss": "elementwise",
    "aten::div": "elementwise",
    "aten::sum": "elementwise",
    "aten::embedding": "elementwise",
}


def group(name: str) -> str:
    return next((g for prefix, g in GROUPS.items() if name.startswith(prefix)), "other")


def main() -> None:
    cfg = expand([*sys.argv[1:], "kind=throughput"], single=True)[0]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    machine.keep_freed_memory()  # as a worker does
    trainer = Trainer(cfg)
    for _ in range(WARMUP):
        trainer.step()
    times = []
    for _ in range(TIMED):
        dist.barrier()
        start = time.perf_counter()
        trainer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED):
            trainer.step()
        dist.barrier()
    if dist.get_rank() == 0:
        groups: dict[str, float] = {}
        for event in prof.key_averages():  # self time: no op is counted twice
            g = group(event.key)
            groups[g] = groups.get(g, 0.0) + event.self_cpu_time_total / 1e6 / PROFILED
        print(f"step, median of {TIMED} without the profiler: {statistics.median(times):.3f} s")
        print(f"per step under the profiler, rank 0 ({PROFILED} steps, self CPU time):")
        for g, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {g:22s} {seconds:7.3f} s")
        print(f"  {'total':22s} {sum(groups.values()):7.3f} s")
        predicted = steptime.predict_time(cfg, steptime.cpu_rates(cfg, 1))
        print("the time model's step (tpbench.predict.steptime), by class:")
        for kind, seconds in sorted(predicted.by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:22s} {seconds:7.3f} s")
        print(f"  {'total':22s} {predicted.step_s:7.3f} s")
        rows = int(os.environ.get("ROWS", 20))  # the table's length
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
