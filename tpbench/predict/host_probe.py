"""The host's cost of issuing one op on the GPU at hand: the time model's Rates.host_op_s where the
plan is for this machine's GPU (tpbench.predict.steptime.host_op_s; for a GPU not at hand the sourced
steptime.rates.HOST_OP_S). Never run on a GPU yet: none was lent to the session that wrote it."""

from __future__ import annotations

import functools
import subprocess
import sys
import time

import torch


@functools.cache
def cuda_host_op_s() -> float:
    """The host's time to issue one eager aten op on the GPU at hand (the time model's
    Rates.host_op_s, steptime.rates.HOST_OP_S's probe), in a process of its own (a CUDA context
    made here would hold the GPU's memory for the rest of the command: rate_probe.probe_in_child)."""
    code = "from tpbench.predict import host_probe; print(host_probe.host_op_probe())"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return float(done.stdout.split()[-1])


def host_op_probe(calls: int = 2000, reps: int = 5) -> float:
    """Seconds the host takes per `torch.add` of two [512, 512] CUDA tensors issued back to back, the
    GPU synchronised once before and after (its kernels queue behind the host: the host's time is the
    issue's, not the device's); the median of `reps`."""
    a = torch.randn(512, 512, device="cuda")
    b = torch.randn(512, 512, device="cuda")
    for _ in range(100):  # warm: the kernel loaded, the allocator's blocks cached
        torch.add(a, b)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            torch.add(a, b)
        times.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return sorted(times)[reps // 2]
