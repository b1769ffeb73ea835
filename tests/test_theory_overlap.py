"""Overlap's memory (`parallel.overlap=true`) at T 2, dp 1, in test_parallel's world-2 job (tests/
torchrun_checks.py `WORLD2`; test_theory.py's world-4 launch holds the dp 2 and T 4 overlap cases):
every rank's measured peak equals the model's to the byte.

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
"""

from __future__ import annotations

from pathlib import Path

import pytest
from beside import beside
from test_theory import SMALL
from torchrun_checks import WORLD2, per_config, run_config

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
WORLD2.add("memory", "overlap", {name: SMALL + overrides for name, overrides in CHECKS.items()})


@beside
def measured(folder: Path) -> dict:
    """Per config, every rank's measured peak (test_parallel's world-2 job)."""
    return per_config(WORLD2.part(folder, "memory", "overlap"))


@pytest.mark.parametrize("name", CHECKS)
def test_overlap_peak_is_predicted_to_the_byte(measured, name):
    predicted = theory.predict(run_config(SMALL + CHECKS[name])).peak_bytes
    assert [rank["peak"] for rank in measured[name]] == [predicted] * len(measured[name])
