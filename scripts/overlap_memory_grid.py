"""Overlap's memory model on emulated ranks, a grid: `parallel.overlap=true` at dp 1 and 2, T 2 and 4,
S 4 and 64, every recompute setting, SP and VP on and off, mixed and pure precision (L 3, the tests'
H 64 model), each config's busiest rank measured on fake tensors in this process
(`memory.measure_busiest`, MemTracker's peak) against `theory.predict`. Prints the configs that differ
and the count equal (docs/theory.md, "Overlap under recompute").

    .venv/bin/python scripts/overlap_memory_grid.py
"""

from __future__ import annotations

import itertools
import sys
import time

from tpbench.experiments import memory
from tpbench.predict import theory
from tpbench.run import compose

MODEL = ["kind=memory", "model.hidden_size=64", "model.num_hidden_layers=3", "model.vocab_size=512"]


def main() -> int:
    started, n, off = time.perf_counter(), 0, 0
    grid = itertools.product([1, 2], [2, 4], [4, 64], ["none", "selective", "full"], [False, True],
                             [False, True], ["mixed", "pure"])  # fmt: skip
    for dp, tp, seq, recompute, sp, vp, precision in grid:
        overrides = [*MODEL, "train.dtype=bfloat16", "launch.emulate=fake", "parallel.overlap=true",
                     f"parallel.dp={dp}", f"parallel.tp={tp}", f"train.seq_len={seq}",
                     f"train.recompute={recompute}", f"parallel.sp={str(sp).lower()}",
                     f"parallel.vp={str(vp).lower()}", f"train.precision={precision}"]  # fmt: skip
        (cfg,) = compose.expand(overrides, launching=False)
        measured, _ = memory.measure_busiest(cfg)
        predicted = theory.predict(cfg)
        n += 1
        if (diff := int(measured["peak_bytes"]) - predicted.peak_bytes) != 0:
            off += 1
            print(f"dp {dp} T {tp} S {seq} {recompute} sp={sp} vp={vp} {precision}: measured - "
                  f"predicted {diff:+,} B (model's peak: {predicted.peak.name})")  # fmt: skip
    print(f"{n - off} of {n} configs equal to the byte ({time.perf_counter() - started:.0f} s)")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
