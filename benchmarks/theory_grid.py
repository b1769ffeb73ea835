"""The analytic model against the fake-tensor emulation of one rank, over a grid wider than the test
configs: 7 modes x fp32 / bf16 / mixed x S 4, 8, 16 x 8 model variants (tests/test_theory.py's SMALL
model: H 64, L 2, heads 8/4, I 256, V 512, micro-batch 2; as is, V 256, untied, MiniMind's own ops,
selective recompute, and the families Llama, Qwen2.5 and Qwen3 of tests/torchrun_checks.py), where
few tokens beside the weights move the peak to the weight gradients' moments. Prints each config whose
peak is not predicted to the byte, then the count. In-process, no launcher (about two minutes).
Run: .venv/bin/python benchmarks/theory_grid.py"""

import dataclasses
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_theory import SMALL  # noqa: E402
from torchrun_checks import FAMILIES, run_config  # noqa: E402

from tpbench.experiments import memory  # noqa: E402
from tpbench.predict import theory  # noqa: E402
from tpbench.run.compose import check  # noqa: E402

MODES = {
    "ddp": ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=2"],
    "dp2": ["parallel.tp=1", "parallel.dp=2"],
    "tp2": ["parallel.tp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp2_vp": ["parallel.tp=2", "parallel.vp=true"],
    "tp2_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
    "t4_sp_vp": ["parallel.tp=4", "parallel.sp=true", "parallel.vp=true"],
}
PRECISIONS = {"fp32": ["train.dtype=float32"], "bf16": [], "mixed": ["train.precision=mixed"]}
VARIANTS = {
    "": [],
    "v256": ["model.vocab_size=256"],
    "untied": ["model.tie_word_embeddings=false"],
    "seed_ops": ["model.fused_swiglu=false", "model.lean_rmsnorm=false"],
    "selective": ["train.recompute=selective"],
    **FAMILIES,  # Llama, Qwen2.5 (biases, head_dim 16), Qwen3 (head_dim 16)
}


def main() -> None:
    measured = unequal = 0
    grid = itertools.product(MODES.items(), PRECISIONS.items(), (4, 8, 16), VARIANTS.items())
    for (mode, m), (precision, p), seq, (variant, v) in grid:
        cfg = run_config(SMALL + m + p + [f"train.seq_len={seq}"] + v)
        try:
            check(cfg)
        except ValueError:
            continue  # a combination compose refuses (MiniMind's own ops with recompute)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, warmup=1, steps=1))
        peak = next(x.value for x in memory.measure_in_process(cfg).measurements if x.name == "peak_bytes")
        predicted = theory.predict(cfg)
        measured += 1
        if predicted.peak_bytes != peak:
            unequal += 1
            name, gap = f"{mode} {precision} S {seq} {variant}", predicted.peak_bytes - int(peak)
            print(
                f"{name}: measured {int(peak)}, {gap:+d} B predicted (at {predicted.peak.name})", flush=True
            )
    print(f"{measured} configs, {unequal} not predicted to the byte")


if __name__ == "__main__":
    main()
