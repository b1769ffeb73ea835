"""FLOPs of one training step: the model's (forward + backward of every matmul) and what full or
per-op activation recompute adds.
"""

from __future__ import annotations

from tpbench.config import RunConfig
from tpbench.predict.theory.dims import Dims, dims


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
    MLP dropout's mask, down_proj's matmul included. Op remakes every second aten.mm of a block's
    forward (`op_recomputed_linears`); manual attention's matmuls (aten.bmm) it keeps."""
    d = dims(cfg)
    N, H = d.N, d.H
    if d.recompute == "op":
        widths = dict(op_linears(d))
        weights = sum(2 * N * widths[name] for name in op_recomputed_linears(d))
        return float(d.L * weights * d.T * d.dp)
    if d.recompute != "full":
        return 0.0
    mlp = 3 if d.dropout else 2  # gate, up (and down)
    weights = 2 * N * H * (2 * d.Hq + 2 * d.Hkv + mlp * d.I_l)  # q, o; k, v; the MLP's
    attention = 2 * 2 * d.B * d.Nq_l * d.S * d.S * d.D  # Q K^T and P V
    return float(d.L * (weights + attention) * d.T * d.dp)


def op_linears(d: Dims) -> list[tuple[str, int]]:
    """A block's linears in the order its forward runs them, each with its weight's elements on this
    rank (in x out)."""
    return [
        ("q_proj", d.H * d.Hq),
        ("k_proj", d.H * d.Hkv),
        ("v_proj", d.H * d.Hkv),
        ("o_proj", d.Hq * d.H),
        ("gate_proj", d.H * d.I_l),
        ("up_proj", d.H * d.I_l),
        ("down_proj", d.I_l * d.H),
    ]


def op_kept_linears(d: Dims) -> list[str]:
    """The linears whose output recompute=op keeps (tpbench.parallel.recompute): q, k and v with
    biases (aten.addmm, kept and not counted), then every odd one of the block's aten.mm ops."""
    addmm = ("q_proj", "k_proj", "v_proj") if d.bias else ()
    counted = [name for name, _ in op_linears(d) if name not in addmm]
    return [*addmm, *counted[::2]]


def op_recomputed_linears(d: Dims) -> list[str]:
    """The linears whose matmul recompute=op runs again in a block's backward: those it does not keep,
    but for down_proj's: the recomputation stops when down_proj's matmul saves its input, before it
    runs, unless a dropout after it saves its mask."""
    kept = op_kept_linears(d)
    return [name for name, _ in op_linears(d) if name not in kept and (name != "down_proj" or d.dropout)]
