"""The CUDA-event timing (tpbench.parallel.timing) on a real GPU, in one process of one rank.

    python benchmarks/cuda_timing_check.py        (exit 0: every check passed; 1: one failed; 2: no GPU)

A one-rank NCCL group runs an all-gather into a tensor of its own as a copy on NCCL's stream (1 GiB: about
0.5 ms, long beside the host's few microseconds between two launches),
launched through collectives' `_launch` as tpbench launches collectives, under a counter timed by
CudaEventTimer. Between a launch and its wait, the compute stream runs `torch.cuda._sleep`: one
spinning block, which leaves the SMs to the copy. NCCL's own timing of each collective
(TORCH_NCCL_ENABLE_TIMING=1, `Work._get_duration()`) is the reference, or where this torch has none
the same copy timed by events on the compute stream. Checks:
  blocking      total within 20% (+50 us) of NCCL's duration, exposed = total;
  hidden        5 ms of compute before the wait: total still NCCL's duration (not the 5 ms to the
                wait), exposed under 10% of it;
  at once       waited right after the launch: at least 80% exposed;
  no sync       no torch.cuda.synchronize between the first launch and the last wait;
  step          CudaEventSteps over a step of 5 ms of compute within 10% (+0.2 ms) of the wall clock
                between two synchronisations.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from tpbench.parallel import collectives, instrumentation, timing

os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # before the group is made


def sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda_timing_check: no GPU here; nothing checked", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    with tempfile.NamedTemporaryFile() as f:
        store = dist.FileStore(f.name, 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        try:
            return check()
        finally:
            dist.destroy_process_group()


def check() -> int:
    cycles = sleep_cycles_per_ms()
    group = dist.group.WORLD
    x = torch.randn(256 << 20, device="cuda")  # 1 GiB
    out = torch.empty_like(x)
    works: dict[str, dist.Work] = {}

    def gather(purpose: str, blocking: bool, compute_ms: float) -> None:
        def fn(*_) -> dist.Work:
            works[purpose] = collectives.all_gather_single(out, x, group, async_op=True)
            return works[purpose]

        pending = collectives._launch("all_gather", purpose, x, x.numel() * 4, group, fn, out, blocking)
        if compute_ms:
            torch.cuda._sleep(int(compute_ms * cycles))
        pending.wait()

    gather("warm-up", True, 0)  # NCCL's first collective sets up its communicator
    torch.cuda.synchronize()
    counter = instrumentation.CommCounter(timed=True, timer=timing.collective_timer(x.device, "nccl"))
    syncs, synchronize = [], torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: (syncs.append(1), synchronize(*a, **k))[1]
    try:
        with instrumentation.counting(counter):
            gather("blocking", True, 0)
            gather("hidden", False, 5.0)
            gather("at_once", False, 0)
        inside = len(syncs)
        rows = {r.purpose: r for r in counter.rows()}
    finally:
        torch.cuda.synchronize = synchronize
    try:
        nccl = {purpose: work._get_duration() / 1e3 for purpose, work in works.items()}
        reference = "NCCL's duration"
    except RuntimeError as e:  # no timing in this build of NCCL's group: the copy on the compute stream
        print(f"Work._get_duration: {e}".splitlines()[0])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.copy_(x)
        end.record()
        torch.cuda.synchronize()
        nccl = dict.fromkeys(works, start.elapsed_time(end) / 1e3)
        reference = "the same copy on the compute stream"

    clock = timing.CudaEventSteps()
    step = lambda: torch.cuda._sleep(int(5 * cycles))  # noqa: E731
    by_events = clock.time(step, torch.cuda.synchronize)
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    by_wall = time.perf_counter() - start

    def near(value: float, reference: float, rel: float, slack: float) -> bool:
        return abs(value - reference) <= rel * reference + slack

    b, h, a = rows["blocking"], rows["hidden"], rows["at_once"]
    checks = {
        "blocking": near(b.time_s, nccl["blocking"], 0.2, 50e-6) and b.exposed_s == b.time_s,
        "hidden": near(h.time_s, nccl["hidden"], 0.2, 50e-6) and h.exposed_s < 0.1 * h.time_s,
        "at once": a.exposed_s >= 0.8 * a.time_s,
        "no sync": inside == 0,
        "step": near(by_events, by_wall, 0.1, 0.2e-3),
        "hidden fraction in [0, 1]": all(0 <= r.exposed_s <= r.time_s for r in rows.values()),
    }
    for purpose in ("blocking", "hidden", "at_once"):
        r = rows[purpose]
        print(
            f"{purpose}: total {r.time_s * 1e6:.1f} us, exposed {r.exposed_s * 1e6:.1f} us, "
            f"{reference} {nccl[purpose] * 1e6:.1f} us"
        )
    print(f"synchronize calls inside the step: {inside}")
    print(f"step of 5 ms: events {by_events * 1e3:.3f} ms, wall clock {by_wall * 1e3:.3f} ms")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
