"""The peak's split by category agrees with the measurement's, not its total alone (issue 35): MemTracker
counts every tensor made inside optimizer.step as optimizer state (its Optstate), AdamW's temporaries
included, and so does the analytic model at its optimizer moment. Before, a real model's memory run
that peaked at AdamW's step read optimizer 14.03 against 11.98 MB predicted and temporaries 0 against
2.05. One rank of fake tensors, in this process."""

from __future__ import annotations

from tpbench.experiments import memory
from tpbench.run.compose import expand

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
# Qwen3-0.6B's family (q/k norms, head_dim 64 != H / heads), cut in width and depth so that the peak is
# AdamW's foreach step on an emulated GPU, pure fp32. train.fused_optimizer=false: CUDA's default is
# fused AdamW now (auto), which makes no temporaries, so this rank would peak at the embedding's backward
AT_THE_STEP = [
    "model=qwen3_0_6b",
    "layers=2",
    "hidden=256",
    "heads=2",
    "kv_heads=1",
    "vocab=256",
    "model.intermediate_size=512",
    "model.head_dim=64",
    "seq=8",
    "micro_batch=1",
    "mode=tp",
    "tp=1",
    "dtype=float32",
    "precision=pure",
    "kind=memory",
    "launch.device=cuda",
    "launch.emulate=fake",
    "train.fused_optimizer=false",
]


def test_each_category_agrees_to_the_byte_at_adamws_step():
    (cfg,) = expand(AT_THE_STEP)
    result = memory.measure_in_process(cfg)
    got = {m.name: m.value for m in result.measurements}
    assert result.peak_at.startswith("optimizer"), result.peak_at  # the moment this is about
    measured = {c: got[f"mem_{c}_bytes"] for c in CATEGORIES}
    predicted = {c: got[f"predicted_mem_{c}_bytes"] for c in CATEGORIES}
    assert measured == predicted
    assert measured["temporaries"] == 0 < measured["optimizer"]
    assert got["peak_bytes"] == got["predicted_peak_bytes"]
