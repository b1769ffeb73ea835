"""FLOPs of one training step: the model's (forward + backward of every matmul) and what full
activation recompute adds.
"""

from __future__ import annotations

from tpbench.config import RunConfig
from tpbench.predict.theory.dims import dims


def model_flops_per_step(cfg: RunConfig) -> float:
    """Dense-model FLOPs of one training step on the global batch: forward + backward (= 2 x forward)
    of every matmul, attention counted as the full S x S products (as FlopCounterMode and Megatron's
    formula count them; a causal kernel does about half). Independent of tp: the model's FLOPs."""
    d = dims(cfg)
    H, I, V, S = d.H, d.I, d.V, d.S  # noqa: E741
    q, kv = d.Nq * d.D, d.Nkv * d.D
    per_token_layer = 2 * (2 * H * q + 2 * H * kv + 3 * H * I) + 2 * 2 * S * q  # weights; QK^T, PV
    per_token = d.L * per_token_layer + 2 * H * V  # + the LM head
    return 3.0 * per_token * S * d.B * d.dp


def recompute_flops_per_step(cfg: RunConfig) -> float:
    """FLOPs that activation recompute adds to one training step, summed over every rank (as
    flops_per_step counts them; model FLOPs leave them out). Selective remakes elementwise results
    only: no matmul. Full runs each block's forward again up to down_proj's input: every matmul of
    the block but down_proj's, attention counted as the full S x S products; with dropout, up to the
    MLP dropout's mask, down_proj's matmul included."""
    d = dims(cfg)
    if d.recompute != "full":
        return 0.0
    N, H = d.N, d.H
    mlp = 3 if d.dropout else 2  # gate, up (and down)
    weights = 2 * N * H * (2 * d.Hq + 2 * d.Hkv + mlp * d.I_l)  # q, o; k, v; the MLP's
    attention = 2 * 2 * d.B * d.Nq_l * d.S * d.S * d.D  # Q K^T and P V
    return float(d.L * (weights + attention) * d.T * d.dp)
