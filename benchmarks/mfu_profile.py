"""Where a T 1 training step's time goes, for benchmarks/gpu-check.sh when an MFU goal is missed
(issue 57, item 5): the host's issue time of a step (from the call to its return, the steps back to
back, nothing synchronised between them) beside the device's time per step (CUDA events around the
steps; `host_bound` where issuing takes 90% of it or more), then torch.profiler over a few steps:
the device's time by op class and the ops that take the most of it, and how much of the profiled
wall time the device was busy (idle: waiting on the host). Written to OUT_FILE and printed.

One process, T 1, the run's own Trainer (as `tpbench run kind=throughput` builds it):
  python benchmarks/mfu_profile.py OUT_FILE [tpbench overrides, e.g. model=seed_memory hidden=2048 ...]
On a CPU (device=cpu: gpu-check.sh --dry) the same, the device's times being the CPU's.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tpbench.experiments.training import Trainer
from tpbench.parallel.timing import HOST_BOUND, host_bound
from tpbench.run.compose import expand

WARMUP, TIMED, PROFILED, TOP = 3, 20, 3, 25
# op name prefix -> class; the first that matches, else "other" (as benchmarks/profile_step.py groups)
CLASSES = {
    "aten::mm": "GEMMs",
    "aten::addmm": "GEMMs",
    "aten::bmm": "GEMMs",
    "aten::_scaled_dot_product": "attention (SDPA)",
    "aten::_flash_attention": "attention (SDPA)",
    "aten::_efficient_attention": "attention (SDPA)",
    "aten::_cudnn_attention": "attention (SDPA)",
    "aten::_fused_adamw": "optimizer",
    "aten::_foreach": "optimizer",
    "Optimizer.step": "optimizer",
    "aten::_log_softmax": "loss",
    "aten::nll_loss": "loss",
    "aten::cross_entropy": "loss",
    "aten::_fused_rms_norm": "norms",
    "aten::rms_norm": "norms",
    "CompiledFunction": "compiled blocks (inductor)",
    "## Call CompiledFxGraph": "compiled blocks (inductor)",
    "TorchDynamo Cache Lookup": "compiled blocks (inductor)",
    "triton_": "compiled blocks (inductor)",
    "cpp_fused": "compiled blocks (inductor)",
    "Torch-Compiled Region": "compiled blocks (inductor)",
    "aten::copy_": "copies and casts",
    "aten::_to_copy": "copies and casts",
    "aten::clone": "copies and casts",
    "aten::cat": "copies and casts",
    "aten::": "other aten ops (elementwise, reductions)",
}


def op_class(name: str) -> str:
    return next((c for prefix, c in CLASSES.items() if name.startswith(prefix)), "other")


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    (cfg,) = expand(["kind=throughput", "tp=1", *overrides], single=True)
    cuda = cfg.launch.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        text = measure(cfg, overrides, cuda)
    finally:
        dist.destroy_process_group()
    out.write_text(text)
    print(text, end="")


def measure(cfg, overrides: list[str], cuda: bool) -> str:
    trainer = Trainer(cfg)
    sync = torch.cuda.synchronize if cuda else lambda: None
    start = time.perf_counter()
    trainer.step()
    sync()
    first = time.perf_counter() - start
    for _ in range(WARMUP):
        trainer.step()
    issue, per_step = issue_and_step_time(trainer, sync, cuda)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(PROFILED):
            trainer.step()
        sync()
        wall = time.perf_counter() - start
    lines = [
        f"mfu_profile: T 1, {' '.join(overrides)}",
        f"device {torch.cuda.get_device_name(0) if cuda else 'cpu'}, torch {torch.__version__}, "
        f"train.compile={cfg.train.compile}, train.fused_optimizer={cfg.train.fused_optimizer}",
        f"first step: {first:.2f} s (with train.compile, its compiling)",
        f"{TIMED} steps back to back: host issue time {issue * 1e3:.2f} ms a step (median), step "
        f"{per_step * 1e3:.2f} ms on the device's clock; issue / step {issue / per_step:.2f}: host_bound "
        f"{int(host_bound(issue, per_step))} (issue >= {HOST_BOUND:.0%} of the step)",
        "",
    ]
    lines += breakdown(prof, wall, cuda)
    return "\n".join(lines) + "\n"


def issue_and_step_time(trainer: Trainer, sync, cuda: bool) -> tuple[float, float]:
    """The median host time of one step() call, and the time per step of all of them on the device
    (CUDA events from before the first to after the last; on a CPU the wall clock, synchronous)."""
    sync()
    issue = []
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    start = time.perf_counter()
    for _ in range(TIMED):
        t = time.perf_counter()
        trainer.step()
        issue.append(time.perf_counter() - t)
    if cuda:
        end.record()
    sync()
    total = begin.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - start
    return statistics.median(issue), total / TIMED


def breakdown(prof, wall: float, cuda: bool) -> list[str]:
    """The device's (on a CPU, the CPU's) time a step by op class, each kernel counted once under the
    op that launched it; the kernels that take the most; the device's busy share of the wall time."""
    events = prof.key_averages()
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [e for e in events if e.device_type != DeviceType.CPU]
    self_time = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    by_class: collections.Counter[str] = collections.Counter()
    for e in ops:
        by_class[op_class(e.key)] += self_time(e)
    busy = sum(e.device_time_total for e in kernels) if cuda else sum(by_class.values())
    if cuda and busy > sum(by_class.values()):
        by_class["kernels no op launched (unattributed)"] += busy - sum(by_class.values())
    where = "device (CUDA kernels)" if cuda else "CPU"
    ms = lambda us: f"{us / 1e3 / PROFILED:9.3f}"  # noqa: E731 (us over the profiled steps -> ms a step)
    lines = [
        f"torch.profiler over {PROFILED} steps: wall {wall / PROFILED * 1e3:.2f} ms a step, {where} busy "
        f"{ms(busy).strip()} ms a step ({busy / 1e6 / wall:.0%} of the wall time"
        + ("; the rest the GPU waits on the host)" if cuda else "; threads' times add up)"),
        "",
        f"{where} time by the class of the op that ran it, ms a step:",
    ]
    for name, us in by_class.most_common():
        if us:
            lines.append(f"  {name:<42} {ms(us)}  {us / max(busy, 1):6.1%}")
    top = sorted(kernels if cuda else ops, key=self_time, reverse=True)[:TOP]
    lines += ["", f"the {TOP} {'kernels' if cuda else 'ops'} that take the most, ms a step (calls a step):"]
    lines += [f"  {e.key[:80]:<80} {ms(self_time(e))}  ({e.count // PROFILED})" for e in top if self_time(e)]
    lines += ["", "the host's (CPU) time by op, the top ones:"]
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    return lines


if __name__ == "__main__":
    main()
