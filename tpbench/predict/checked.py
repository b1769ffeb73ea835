"""Where the memory model has not been checked against a measured peak, from the config alone.

Torch-free, so that compose can refuse a memory run the model cannot vouch for before torch loads;
`plan` prints the same reason beside its prediction (tpbench.cli.sharded).
"""

from __future__ import annotations

from tpbench.config import RunConfig


def sharded_unchecked(cfg: RunConfig) -> str | None:
    """Why the memory model of a sharded DP level is not checked for `cfg` (None: it is measured equal
    to the model, to the byte, on the CPU: tests/test_theory_sharded.py, docs/results/sharded_dp.md)."""
    p, t = cfg.parallel, cfg.train
    if p.dp_shard == "none":
        return None
    why = []
    if p.tp > 2:
        why.append(f"tp={p.tp} (measured at tp 1 and 2)")
    if t.precision == "mixed":
        why.append(
            "precision=mixed (bf16 weights in the model: no autocast casts; bf16 gradients copied to fp32)"
        )
    if t.recompute == "full" and p.dp_shard in ("grads", "full"):
        why.append("recompute=full (block 0's backward end is not a moment of the model)")
    if p.dp_replicate > 1:
        why.append(f"dp_replicate={p.dp_replicate} (HSDP's all-reduce buffers)")
    return "; ".join(why) or None
