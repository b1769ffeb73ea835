"""CPU time of tpbench's positional dropout (tpbench.models.dropout) against torch's dropout, on one
thread, forward only, at the attention probabilities' shape of a small run:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/dropout_speed.py [B N S]

Prints the median CPU seconds of each over 20 calls and their ratio. CPU time (process_time), not
wall time, so that a loaded machine reads about the same."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tpbench.models.dropout import PROBS_DIMS, DropoutKey, PositionalDropout


def cpu_seconds(fn, calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    B, N, S = (int(a) for a in argv) if argv else (4, 8, 256)
    x = torch.randn(B, N, S, S)
    ours = PositionalDropout(0.1, 0, PROBS_DIMS, DropoutKey(seed=1)).train()
    fn = cpu_seconds(lambda: ours(x))
    torchs = cpu_seconds(lambda: F.dropout(x, 0.1, training=True))
    shape = f"[{B}, {N}, {S}, {S}] fp32, p 0.1"
    print(f"{shape}: tpbench {fn * 1e3:.1f} ms, torch {torchs * 1e3:.1f} ms: {fn / torchs:.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
