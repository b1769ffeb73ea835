"""Single-core GEMM rate at the TP step's shapes (H 768, heads 8/4, I 2432 as MiniMind makes it from H,
V 6400, T 2, N = S*B = 1024): in fp32, the rate behind the GEMM limit of docs/results/speed.md.
Run: OMP_NUM_THREADS=1 python benchmarks/gemm_rate.py [--dtype bfloat16]"""

import argparse
import statistics
import time

import torch

from tpbench.models.minimind import default_intermediate_size

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
dtype = getattr(torch, parser.parse_args().dtype)
torch.set_num_threads(1)
N, H, V, T = 1024, 768, 6400, 2
I = default_intermediate_size(H)  # noqa: E741
shapes = {
    "qkv (q)": (N, H, H // T),
    "o": (N, H // T, H),
    "gate/up": (N, H, I // T),
    "down": (N, I // T, H),
    "head": (N, H, V),
}
rates = {}
for name, (m, k, n) in shapes.items():
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(15):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    rates[name] = 2 * m * k * n / statistics.median(ts) / 1e9
    print(f"{name:8s} [{m}x{k}]x[{k}x{n}]: {rates[name]:.1f} GFLOP/s")
print(f"median over shapes: {statistics.median(rates.values()):.1f} GFLOP/s")
