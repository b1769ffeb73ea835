"""Figures published elsewhere, with the config each was measured at: the seed chapter (the tensor-parallel
chapter of the MiniMind tutorial whose implementation is github.com/ANKer661/minimind, "minimind-tron";
see docs/references.md).

A report draws them beside ours only for runs of exactly that config, labelled as published.
"""

from __future__ import annotations

import pandas as pd

SEED = "published (seed chapter)"
TRON = "published (minimind-tron)"

# Per-rank peak memory (MiB), T = 2, fixed_per_rank, H 768, S 2048, heads 8/4, V 6400, micro-batch 2,
# bf16, AdamW; DDP over 2 ranks against TP over 2 ranks.
SEED_MEMORY_SETTING = {
    "world_size": 2,
    "hidden": 768,
    "heads": 8,
    "kv_heads": 4,
    "vocab": 6400,
    "seq": 2048,
    "batch_policy": "fixed_per_rank",
    "micro_batch": 2,
    "dtype": "bfloat16",
}
SEED_MEMORY_MIB = {  # layers: (DDP, TP)
    8: (2377.65, 1509.53),
    16: (4433.28, 2717.69),
    32: (8549.79, 5129.40),
    64: (16766.42, 9956.83),
}

# The numerical check: T = 2, H 128, L 6, heads 8/4, V 6400, S 256, fp32, 200 AdamW steps on one fixed
# batch (validate.batch=fixed), the logits compared every 20 steps.
SEED_CHECK_SETTING = {
    "tp": 2,
    "dp": 1,
    "layers": 6,
    "hidden": 128,
    "heads": 8,
    "kv_heads": 4,
    "vocab": 6400,
    "seq": 256,
    "dtype": "float32",
    "adamw_steps": 200,
    "validate_batch": "fixed",
}
SEED_CHECK = {
    "fwd_logits_max_abs": 6.6e-7,
    "loss_abs_diff": 0.0,
    "grad_max_abs": 2.8e-8,
    "grad_max_rel_l2": 1e-6,
    "adamw_logits_max_abs": 1.3e-3,  # the largest over the run
    "adamw_param_max_abs": 6.5e-5,
}


# minimind-tron's throughput comparison: 2 GPUs (RTX 4090D) over PCIe, H 768, L 8, heads 8/4, V 6400,
# S 2048, bf16, fixed_global; its global batch is not stated, so any global batch matches.
TRON_THROUGHPUT_SETTING = {
    "world_size": 2,
    "layers": 8,
    "hidden": 768,
    "heads": 8,
    "kv_heads": 4,
    "vocab": 6400,
    "seq": 2048,
    "batch_policy": "fixed_global",
    "dtype": "bfloat16",
    "device": "cuda",
}
TRON_TOKENS_PER_S = {"ddp": 179.1e3, "tp": 63.4e3}


def matches(run: pd.Series, setting: dict) -> bool:
    return all(key in run and run[key] == value for key, value in setting.items())


def seed_memory(peaks: pd.DataFrame) -> pd.DataFrame:
    """The seed's DDP and TP peaks for the (setting, layers) of `peaks` that match its config:
    setting, layers, mode, peak_bytes."""
    rows = []
    for (setting, layers), group in peaks.groupby(["setting", "layers"]):
        if layers not in SEED_MEMORY_MIB or not matches(group.iloc[0], SEED_MEMORY_SETTING):
            continue
        for mode, mib in zip(("ddp", "tp"), SEED_MEMORY_MIB[layers], strict=True):
            rows.append({"setting": setting, "layers": layers, "mode": mode, "peak_bytes": mib * 2**20})
    return pd.DataFrame(rows, columns=["setting", "layers", "mode", "peak_bytes"])


def seed_check_matches(run: pd.Series) -> bool:
    return matches(run, SEED_CHECK_SETTING)


def tron_throughput_matches(run: pd.Series) -> bool:
    return matches(run, TRON_THROUGHPUT_SETTING)
