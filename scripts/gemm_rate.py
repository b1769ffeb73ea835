"""Single-core fp32 GEMM rate at the TP step's shapes (H 768, heads 8/4, I 2048, V 6400, T 2, N = S*B = 1024):
the rate behind the README's GEMM limit. Run: OMP_NUM_THREADS=1 python scripts/gemm_rate.py"""

import statistics
import time

import torch

torch.set_num_threads(1)
N, H, I, V, T = 1024, 768, 2048, 6400, 2  # noqa: E741
shapes = {
    "qkv (q)": (N, H, H // T),
    "o": (N, H // T, H),
    "gate/up": (N, H, I // T),
    "down": (N, I // T, H),
    "head": (N, H, V),
}
rates = {}
for name, (m, k, n) in shapes.items():
    a, b = torch.randn(m, k), torch.randn(k, n)
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
