"""The time model against Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Table 4: one transformer layer of their 22B GPT at TP 8 on eight A100-80GB
(NVLink/NVSwitch), forward / backward / total ms, predicted beside published.

    .venv/bin/python benchmarks/korthikanti_table4.py

The mapping: h 6144, 64 heads, s 2048, micro-batch 4, vocab 51200, bf16, dropout 0.1, one layer.
tpbench's block is Llama-style (RMSNorm, SwiGLU, rotary): SwiGLU's intermediate 16384 (8h/3) gives
the GPT MLP's FLOPs (4h GeLU: 2 x 4h x h = 3 x 16384 x h per token); no q/k norms; the manual
attention (Megatron's of 2022: two batched GEMMs and a fused scaled-masked softmax, no flash); with
Megatron's kernels (tpbench.predict.steptime.ops.MEGATRON: fused dropout and softmax, selective =
the attention core remade) and its async TP all-reduce overlapped with the weight gradients
(parallel.overlap). What it changes: RMSNorm for LayerNorm (the same passes here), SwiGLU's
elementwise on 16384 columns for GeLU's on 24576, RoPE (a few passes over q and k) that GPT does
not have. The A100's rates: tpbench.predict.steptime.rates (data sheet x cited fractions), fixed
before this comparison was first run.

The goals (docs/results/time_model.md) are data here, `GOALS`, and `missed` names each one missed:
tests/test_published_times.py holds the model to them.
"""

from __future__ import annotations

import dataclasses

from tpbench.predict import hardware
from tpbench.predict.steptime import gpu_rates, ops, predict_ops
from tpbench.predict.theory import comm_rows, dims
from tpbench.run import compose

MODEL = (
    "model.hidden_size=6144 model.num_attention_heads=64 model.num_key_value_heads=64 "
    "model.intermediate_size=16384 model.vocab_size=51200 model.num_hidden_layers=1 model.qk_norm=false "
    "model.flash_attn=false model.dropout=0.1 model.tie_word_embeddings=false "
    "train.seq_len=2048 train.micro_batch=4 train.dtype=bfloat16 launch.device=cuda launch.emulate=fake "
    "kind=memory"
)
# (row, overrides, published forward / backward / total ms)
ROWS = (
    ("TP", "mode=tp tp=8", (7.7, 11.9, 19.6)),
    ("TP+SP", "mode=tp_sp tp=8", (7.2, 11.8, 19.0)),
    ("full recompute", "mode=tp tp=8 recompute=full", (7.7, 19.5, 27.2)),
    ("selective recompute", "mode=tp tp=8 recompute=selective", (7.7, 13.2, 20.9)),
    ("selective + SP", "mode=tp_sp tp=8 recompute=selective", (7.2, 13.1, 20.3)),
)


# The page's goals, set before the comparison: each total within 15%, but the two rows issue 60 accepts as
# they stood (TP+SP -15.2%, selective + SP -15.5%), which may not move further off; full recompute's
# overhead over TP 30-45% and selective's 3-12%; each SP row within 5% of the same row without SP.
TOTAL_WITHIN = 0.15
ACCEPTED = {"TP+SP": 0.152, "selective + SP": 0.155}  # |error| as accepted, to the page's 0.1%
OVERHEADS = {"full recompute": (0.30, 0.45), "selective recompute": (0.03, 0.12)}  # over TP's total
SP_PAIRS = {"TP+SP": "TP", "selective + SP": "selective recompute"}
SP_WITHIN = 0.05


def predicted() -> dict[str, tuple[float, float, float]]:
    """Each row's predicted forward, backward and total ms."""
    rates = gpu_rates(hardware.gpu("A100-80GB"), "bfloat16")
    rows = {}
    for name, line, _ in ROWS:
        recompute = line.split("recompute=")[1] if "recompute=" in line else "none"
        (cfg,) = compose.expand([*MODEL.split(), *line.split(" recompute=")[0].split()])
        # compose models overlap's memory without recompute only: the step's sizes with both set here
        d = dataclasses.replace(dims(cfg), overlap=True, recompute=recompute)
        p = predict_ops(d, comm_rows(cfg), rates, ops.MEGATRON, layer_only=True)
        forward, backward = 1e3 * p.by_phase.get("forward", 0), 1e3 * p.by_phase.get("backward", 0)
        rows[name] = (forward, backward, forward + backward)
    return rows


def missed(totals: dict[str, float]) -> list[str]:
    """Each goal the predicted totals (ms by row) miss, in words; [] when every goal is met."""
    published = {name: ms[2] for name, _, ms in ROWS}
    misses = []
    for name, total in totals.items():
        error = total / published[name] - 1
        bound = ACCEPTED[name] + 5e-4 if name in ACCEPTED else TOTAL_WITHIN  # 5e-4: the page's rounding
        if abs(error) > bound:
            misses.append(f"{name}: total {total:.1f} ms, {100 * error:+.1f}% of {published[name]} ms")
    for name, (low, high) in OVERHEADS.items():
        over = totals[name] / totals["TP"] - 1
        if not low <= over <= high:
            misses.append(f"{name} over TP: {100 * over:+.1f}% (goal {low:.0%}-{high:.0%})")
    for name, without in SP_PAIRS.items():
        change = totals[name] / totals[without] - 1
        if abs(change) > SP_WITHIN:
            misses.append(f"{name} against {without}: {100 * change:+.1f}% (goal within {SP_WITHIN:.0%})")
    return misses


def main() -> None:
    print(f"rates: {gpu_rates(hardware.gpu('A100-80GB'), 'bfloat16').source}")
    print(f"{'row':22} {'forward ms':>16} {'backward ms':>16} {'total ms':>22}")
    rows = predicted()
    for name, _, published in ROWS:
        got = rows[name]
        cells = [f"{g:6.1f} ({w:4.1f})" for g, w in zip(got, published, strict=True)]
        error = 100 * (got[2] / published[2] - 1)
        print(f"{name:22} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} {error:+5.1f}%")
    totals = {name: ms[2] for name, ms in rows.items()}
    tp = totals["TP"]
    full = 100 * (totals["full recompute"] / tp - 1)
    print(f"full recompute over TP: {full:+.1f}% (goal 30-45%; published +38.8%)")
    selective = 100 * (totals["selective recompute"] / tp - 1)
    print(f"selective over TP: {selective:+.1f}% (goal 3-12%; published +6.6%)")
    sp = totals["TP+SP"] / tp - 1
    sel_sp = totals["selective + SP"] / totals["selective recompute"] - 1
    print(f"SP against the same row without: TP {100 * sp:+.1f}%, selective {100 * sel_sp:+.1f}% (goal: 5%)")
    misses = missed(totals)
    print("goals: " + ("every one met" if not misses else "missed: " + "; ".join(misses)))


if __name__ == "__main__":
    main()
