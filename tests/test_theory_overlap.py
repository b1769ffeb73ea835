"""Overlap's memory (`parallel.overlap=true`) at T 2, dp 1, in test_parallel's world-2 job (tests/
torchrun_checks.py `WORLD2`), and under mixed precision at dp 2 in the world-4 job (`WORLD4`, beside
test_theory.py's dp 2 and T 4 overlap cases): every rank's measured peak equals the model's to the byte.

- `tp_sp_vp_overlap_s4`: SP's re-gathers, prefetched at each region's exit backward, let go once
  prefetched. Held by the hook to the step's end (the graph lives as long as the loss the step
  returns), the four regions' gathered inputs and shards put the peak at the optimizer step, 6,144 B
  above the model.
- `tp_sp_vp_overlap_s4_fused`: with the fused AdamW (no temporaries at its step) the peak is the
  embedding's backward, where the tied LM head's deferred weight gradient is already `.grad`: every
  gradient held, the embedding's being made, and no third tensor summing the two (the blocking order's
  moment, 32,768 B higher).
- `tp_vp_overlap_untied_s8_fused`: the untied embedding's backward, the peak, with the
  vocab-parallel embedding's ids copied contiguous ([S, B] int64: 8 N bytes).
- `..._mixed`: under mixed precision the LM head's weight gradient, deferred to its entry's backward,
  is made in bf16 and cast to fp32 there, while the logits' gradient it is made from is still live (its
  bf16 weight cast gone): the head's backward moment + V/T x H x (4 - 2) B (32,768 B here).
- `..._selective...`, `..._full_mixed`: overlap under recompute at dp 1. SP's re-gathered region input,
  prefetched at the region's exit backward, is alive through all of the region's backward (the top
  block's down_proj and SwiGLU backward under selective, the softmax's under manual attention); at dp 2
  (world-4 job) the late gradients (the final norm's, SP's norms') stay autograd's own beside the flat
  DP buckets in every moment of backward once made. Every case is modelled now (emulated in
  process below: 192 configs of L 3 equal, scripts and figures in docs/theory.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from beside import beside
from test_theory import SMALL
from torchrun_checks import WORLD2, WORLD4, per_config, run_config

from tpbench.predict import theory

T2_SP_VP = ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true", "parallel.overlap=true"]
FUSED = "train.fused_optimizer=true"
CHECKS = {
    "tp_sp_vp_overlap_s4": [*T2_SP_VP, "train.seq_len=4"],
    "tp_sp_vp_overlap_s4_fused": [*T2_SP_VP, "train.seq_len=4", FUSED],
    "tp_vp_overlap_untied_s8_fused": [
        "parallel.tp=2",
        "parallel.vp=true",
        "parallel.overlap=true",
        "train.seq_len=8",
        "model.tie_word_embeddings=false",
        FUSED,
    ],
}
MIXED = "train.precision=mixed"
PURE, SP_VP = "train.precision=pure", ["parallel.sp=true", "parallel.vp=true"]
CHECKS["tp_sp_vp_overlap_mixed"] = [*T2_SP_VP, MIXED]
CHECKS["tp_sp_vp_overlap_mixed_s32"] = [*T2_SP_VP, MIXED, "train.seq_len=32"]
# under recompute: SP's re-gathered region input, prefetched at the region's exit backward, is alive
# through its backward (the MLP's under selective: +16,384 B; per linear, gate's and up's: +32,768 B)
SELECTIVE, FULL = "train.recompute=selective", "train.recompute=full"
CHECKS["tp_sp_vp_overlap_selective"] = [*T2_SP_VP, SELECTIVE]
CHECKS["tp_sp_vp_overlap_selective_linear"] = [*T2_SP_VP, SELECTIVE, "parallel.sp_gather=linear"]
CHECKS["tp_sp_vp_overlap_selective_manual"] = [*T2_SP_VP, SELECTIVE, "model.flash_attn=false"]
CHECKS["tp_sp_vp_overlap_full_mixed"] = [*T2_SP_VP, FULL, MIXED]
WORLD4_CHECKS = {"dp2_tp_sp_vp_overlap_mixed": [*T2_SP_VP, "parallel.dp=2", MIXED]}
# under recompute at dp 2: the late gradients (the final norm's, SP's norms') autograd's own beside the
# flat DP buckets in every moment of backward (+128 B at the top MLP's, where selective peaks)
WORLD4_CHECKS["dp2_tp_sp_vp_overlap_selective"] = [*T2_SP_VP, "parallel.dp=2", SELECTIVE]
MANUAL = "model.flash_attn=false"
WORLD4_CHECKS["dp2_tp_sp_vp_overlap_full_manual"] = [*T2_SP_VP, "parallel.dp=2", FULL, MANUAL]
# under recompute at dp 2 in mixed precision, on real ranks too: selective's top down_proj backward
# (SP: the gradient's cast shard gathered), full recompute's down_proj weight cast at S 4 (VP, no SP)
WORLD4_CHECKS["dp2_tp_sp_vp_overlap_selective_mixed"] = [*T2_SP_VP, "parallel.dp=2", SELECTIVE, MIXED]
T2_VP = ["parallel.tp=2", "parallel.vp=true", "parallel.overlap=true"]
WORLD4_CHECKS["dp2_tp_vp_overlap_full_mixed_s4"] = [*T2_VP, "parallel.dp=2", FULL, MIXED, "train.seq_len=4"]
WORLD2.add("memory", "overlap", {name: SMALL + overrides for name, overrides in CHECKS.items()})
WORLD4.add("memory", "overlap", {name: SMALL + overrides for name, overrides in WORLD4_CHECKS.items()})


@beside
def measured(folder: Path) -> dict:
    """Per config, every rank's measured peak (test_parallel's world-2 job)."""
    w2, w4 = (per_config(w.part(folder, "memory", "overlap")) for w in (WORLD2, WORLD4))
    return w2 | w4


@pytest.mark.parametrize("name", CHECKS | WORLD4_CHECKS)
def test_overlap_peak_is_predicted_to_the_byte(measured, name):
    predicted = theory.predict(run_config(SMALL + (CHECKS | WORLD4_CHECKS)[name])).peak_bytes
    assert [rank["peak"] for rank in measured[name]] == [predicted] * len(measured[name])


def test_plan_models_overlap_under_mixed_precision_and_under_recompute_with_dp():
    from typer.testing import CliRunner

    from tpbench.cli import app
    from tpbench.run import compose

    assert (
        CliRunner()
        .invoke(app, ["plan", "tp=2", "overlap=true", "dtype=bfloat16", "precision=mixed"])
        .exit_code
        == 0
    )
    selective = ["kind=memory", "tp=2", "overlap=true", "train.recompute=selective"]
    assert len(compose.expand(selective, launching=False)) == 1  # dp 1: modelled, measured
    assert len(compose.expand([*selective, "dp=2"], launching=False)) == 1  # dp 2 in pure precision
    mixed = [*selective, "dp=2", "vp=true", "precision=mixed", "dtype=bfloat16"]
    assert len(compose.expand(mixed, launching=False)) == 1  # dp 2 in mixed precision, VP too
    assert len(compose.expand([*mixed, "train.recompute=full"], launching=False)) == 1


# Emulated ranks (fake tensors, in process) of overlap under recompute and mixed precision, each seen
# off the model before its moment was fixed: the LM head entry's all-reduce of a clone of the input
# gradient beside the deferred weight gradient (without SP, S 4: 1,024 B); the column linears' weight
# casts made outside autocast's cache, so not held to the forward's end under full recompute (L 3:
# 54,272 B); the tied head's gradient, a late one under the flat DP buckets, beside the embedding's
# backward (V 4096, S 4); the MLP entry's deferred weight gradients (pure precision, S 4, SP and VP:
# 10,240 B); under SP the gradient's bf16 cast, a shard, gathered, not a second [N, H]
# (selective: 8,448 B at S 64, 1,024 B at S 4); the MLP entry's deferred weight gradients and a
# recomputed block's down_proj backward and its weight gradient's fp32 cast (full recompute, VP:
# 8,192 B under SP at S 64; 13,312 B at S 4; pure precision at S 4: 12,288 B)
EMULATED = {
    "mlp_entry_dp2_sp_vp_s4_pure": ["parallel.dp=2", *SP_VP, "train.seq_len=4", PURE],
    "selective_dp2_sp_vp": ["train.recompute=selective", "parallel.dp=2", *SP_VP],
    "selective_dp2_sp_vp_s4": ["train.recompute=selective", "parallel.dp=2", *SP_VP, "train.seq_len=4"],
    "full_dp2_sp_vp": ["train.recompute=full", "parallel.dp=2", *SP_VP],
    "full_dp2_vp_s4": ["train.recompute=full", "parallel.dp=2", "parallel.vp=true", "train.seq_len=4"],
    "full_dp2_vp_s4_pure": [
        "train.recompute=full",
        "parallel.dp=2",
        "parallel.vp=true",
        "train.seq_len=4",
        PURE,
    ],
    "head_entry_clone_dp2_s4": ["parallel.vp=true", "parallel.dp=2", "train.seq_len=4"],
    "full_l3_casts_dp1": ["train.recompute=full", "model.num_hidden_layers=3"],
    "full_l3_casts_dp2_sp": [
        "train.recompute=full",
        "model.num_hidden_layers=3",
        "parallel.dp=2",
        "parallel.sp=true",
    ],
    "selective_dp2_sp_s4": [
        "train.recompute=selective",
        "parallel.dp=2",
        "parallel.sp=true",
        "train.seq_len=4",
    ],
    "backward_end_flat_dp_v4096": [
        "parallel.vp=true",
        "parallel.dp=2",
        "train.seq_len=4",
        "model.vocab_size=4096",
    ],
}


@pytest.mark.parametrize("name", EMULATED)
def test_emulated_overlap_under_recompute_in_mixed_precision_is_predicted_to_the_byte(name):
    from tpbench.experiments import memory

    overrides = EMULATED[name] if PURE in EMULATED[name] else [*EMULATED[name], MIXED]
    cfg = run_config([*SMALL, "launch.emulate=fake", "parallel.tp=2", "parallel.overlap=true", *overrides])
    measured, _ = memory.measure_busiest(cfg)
    assert measured["peak_bytes"] == theory.predict(cfg).peak_bytes
