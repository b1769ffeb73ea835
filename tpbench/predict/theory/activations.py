"""Activations: the bytes the forward saves for backward on one rank, per block (`layer_activations`,
term by term) and outside the blocks (`model_activations`), under each precision and recompute
setting. Where each term comes from, with the paper's per-layer coefficients beside tpbench's, is in
docs/theory.md, "Activation memory per layer".

The terms of a block (recompute none), as shapes on this rank (Ns tokens of the stream, N gathered):
  input_layernorm, post_attention_layernorm   lean: the input [Ns, H]; else its fp32 copy [Ns, H],
                     rsqrt [Ns, 1] and the fp32 normed tensor [Ns, H]
  attention input, mlp input   [N, H] shared by q, k, v (gate, up); SP with the re-gather: [Ns, H];
                     one each where each linear casts or gathers its own
  q_norm, k_norm     the same over [N, Nq/T, D] and [N, Nkv/T, D]
  rope tables        cos, sin [S, D] in p, for q and for k (once for both where the block's input is
                     cast: FSDP2's MixedPrecisionPolicy); none with model.fused_ops (made once in p)
  q, k, v            [N, Nq/T D] each, k and v repeated out to the query heads (`kv_widths`; SDPA
                     with model.fused_ops: at their own heads)
  attention core     SDPA: its output [N, Nq/T D] and logsumexp [B, Nq/T, S] (fp32); manual: the
                     fp32 softmax [B, Nq/T, S, S], its cast, and o_proj's input [N, Nq/T D]
  swiglu             gate, up and their product [N, I/T] (MiniMind's unfused ops: silu(gate) too)
  dropout (model.dropout > 0): each dropout's 1-byte mask: after o_proj and after down_proj [Ns, H]
                     (`stream dropouts`); the attention probabilities' [B, Nq/T, S, S] and their
                     dropped copy, which P V saves instead of the softmax's cast (in the core's term)
  weight casts       mixed precision: each linear's bf16 weight
"""

from __future__ import annotations

from dataclasses import replace

from tpbench.predict.theory.dims import FP32, INT32, INT64, Dims
from tpbench.predict.theory.flops import op_kept_linears
from tpbench.predict.theory.weights import block_linears, layer_params


def layer_activations(d: Dims) -> dict[str, int]:
    """Bytes one block saves for backward on this rank, term by term, under d.recompute.

    p is the activation dtype: train.dtype, or the autocast dtype under mixed precision, where the
    stream and the norms stay fp32 (d.s) and every autocast op saves its own bf16 casts: the linears'
    weights are cast once per forward (and kept, saved, until their backward); with T > 1 each region
    entry casts its input once for all its linears, while the dense model's (T = 1) q, k, v (gate,
    up) each cast it.

    A lean RMSNorm (model.lean_rmsnorm) keeps its input instead of its fp32 copy, rsqrt and fp32
    result. selective keeps gate and up instead of the three SwiGLU tensors (down_proj's weight cast,
    made inside, is remade too); full keeps the block's input only (under mixed precision the casts
    it remakes are still held, by autocast's cache, until the forward ends: `forward_only_casts`)."""
    N, Ns, S, B, H, p = d.N, d.Ns, d.S, d.B, d.H, d.p
    if d.recompute == "op":
        return op_kept(d)
    if d.recompute == "full":  # the stream entering the block, [S(/T), B, H] (and FSDP2's cast cos, sin)
        rope = 2 * S * d.D * p if d.rope_cast_once and not d.fused_ops else 0
        return {"block input": d.s * Ns * H, "weight casts": 0, "rope tables": rope}
    selective, lean = d.recompute == "selective", d.lean_rmsnorm
    # fp32 input, rsqrt [Ns, 1], fp32 normed (the weight's mul saves it); lean: the input
    rmsnorm = d.s * Ns * H if lean else 2 * FP32 * Ns * H + FP32 * Ns
    if (d.mixed and not d.cast_once) or (d.per_linear and not d.block_regather):
        # q, k, v each save their own copy, gate and up too: a cast of the fp32 input (dense, mixed),
        # or the [S, B, H] each all-gathered (SP with parallel.sp_gather=linear, no re-gather)
        attn_input, mlp_input = 3 * p * N * H, 2 * p * N * H
    else:  # one tensor q/k/v (gate/up) share: under SP with the re-gather, only this rank's shard
        attn_input = mlp_input = p * d.saved_input_tokens * H
    k_width, v_width = kv_widths(d)
    if d.flash:  # SDPA saves its output (o_proj's input is a view of it) and the logsumexp
        core = p * N * d.Hq + FP32 * B * d.Nq_l * S
    else:  # fp32 softmax output, its cast (unless it is fp32 already), o_proj's input copy
        core = (FP32 + probs_saved(d)) * B * d.Nq_l * S * S + p * N * d.Hq

    def head_norm(width: int, heads: int) -> int:  # q_norm / k_norm over [N, heads, D]
        return p * N * width if lean else 2 * FP32 * N * width + FP32 * N * heads

    terms = {
        "input_layernorm": rmsnorm,
        "attention input": attn_input,
        "q_norm": head_norm(d.Hq, d.Nq_l) if d.qk_norm else 0,
        "k_norm": head_norm(d.Hkv, d.Nkv_l) if d.qk_norm else 0,
        "rope tables": rope_casts(d),
        "q, k, v": p * N * (d.Hq + k_width + v_width),
        "attention core": core,
        "post_attention_layernorm": rmsnorm,
        "mlp input": mlp_input,
        # gate, up; the product (down_proj's input); MiniMind's unfused ops keep silu(gate) too
        "swiglu": (2 if selective else 3 if d.fused_swiglu else 4) * p * N * d.I_l,
    }
    if d.mixed:
        terms["weight casts"] = p * block_linears(d) - forward_only_casts(d) // d.L
    if d.dropout:
        terms["attention output dropout"] = terms["mlp output dropout"] = stream_mask(d)
    return terms


def op_kept(d: Dims) -> dict[str, int]:
    """What a block keeps under recompute=op (tpbench.parallel.recompute): the outputs its policy
    saves, beside its input, which the checkpoint holds for the recomputation. Of the linears, those
    of `op_kept_linears` (q, v, gate and down in a Llama block; addmm's q, k, v with biases, then o
    and up); the attention kernel's output and logsumexp (manual attention: the two batched matmuls'
    outputs, the scores [B Nq/T, S, S] and P V); every collective's output: SP's all-gathered region
    inputs [N, H] (one per column linear under sp_gather=linear), the exits' reduce-scatter [Ns, H]
    or all-reduce [N, H] (out of place: beside the row linear's partial sum where that is kept); on
    the dtensor engine only its reduce-scatters (`op_exit_tokens`), its all-gathers recomputed.
    Nothing elementwise, no weight cast (autocast's cache holds those to the forward's end:
    `forward_only_casts`), no dropout mask."""
    N, H, p = d.N, d.H, d.p
    widths = op_widths(d)
    gathers = (3, 2) if d.per_linear else (1, 1) if d.sp and not d.dtensor else (0, 0)
    exit_tokens = op_exit_tokens(d)
    if d.flash:
        core = p * N * d.Hq + FP32 * d.B * d.Nq_l * d.S
    else:
        core = p * d.B * d.Nq_l * d.S * d.S + p * N * d.Hq
    rope = 2 * d.S * d.D * p if d.rope_cast_once and not d.fused_ops else 0
    return {
        "block input": d.s * d.Ns * H,
        "gathered inputs": p * N * H * sum(gathers),
        "linears": sum(p * N * widths[name] for name in op_kept_linears(d)),
        "attention core": core,
        "exits": 2 * p * exit_tokens * H,
        "rope tables": rope,
    }


def op_widths(d: Dims) -> dict[str, int]:
    """Each block linear's output width on this rank."""
    return {"q_proj": d.Hq, "k_proj": d.Hkv, "v_proj": d.Hkv, "o_proj": d.H, "gate_proj": d.I_l,
            "up_proj": d.I_l, "down_proj": d.H}  # fmt: skip


def op_kept_after_scores(d: Dims) -> int:
    """Of what recompute=op keeps (`op_kept`), the outputs a block's forward makes after manual
    attention's scores: while the recomputation is at the softmax they are still in the checkpoint's
    storage (it hands each back to the block's graph when the recomputation reaches its op). The kept
    linears among o_proj and the MLP's, P V's output, the MLP entry's gathers (tpbench's engine under
    SP: one, or two under sp_gather=linear) and both exits' collectives."""
    N, H, p = d.N, d.H, d.p
    widths = op_widths(d)
    after = ("o_proj", "gate_proj", "up_proj", "down_proj")
    linears = sum(p * N * widths[name] for name in op_kept_linears(d) if name in after)
    gathers = 2 if d.per_linear else 1 if d.sp and not d.dtensor else 0
    return linears + p * N * d.Hq + p * N * H * gathers + 2 * p * op_exit_tokens(d) * H


def op_exit_tokens(d: Dims) -> int:
    """Tokens of a block exit's collective output that recompute=op keeps: every one of tpbench's
    engine (custom ops its policy keeps), the dtensor engine's reduce-scatters only (its functional
    all-reduces and all-gathers are recomputed, as torchtitan's policy has them)."""
    if d.sp:
        return d.Ns
    return d.N if d.T > 1 and not d.dtensor else 0


def rope_casts(d: Dims) -> int:
    """cos and sin cast to p in a block and saved by RoPE's muls: for q and for k, or once for both
    (FSDP2's input cast); none in fp32 (the cast is the table) or with model.fused_ops (the tables
    are made in p once, `model_activations`)."""
    if d.p == FP32 or d.fused_ops:
        return 0
    return (2 if d.rope_cast_once else 4) * d.S * d.D * d.p


def probs_saved(d: Dims) -> int:
    """Bytes per attention probability that P V and its dropout keep beside the fp32 softmax output:
    the cast (none in fp32: it is the softmax output); with dropout, its 1-byte mask and the dropped
    copy (the cast, which the dropout does not keep, freed)."""
    if d.dropout:
        return 1 + d.p
    return d.p if d.p != FP32 else 0


def stream_mask(d: Dims) -> int:
    """A stream dropout's 1-byte mask of [Ns, H] (the embedding's, and each block's two); 0 without."""
    return d.Ns * d.H if d.dropout else 0


def mask_bits(elements: int) -> int:
    """What a dropout's hash holds at once while it draws a mask of `elements`: the int32 hash of
    every element and one shifted int32 copy (tpbench.models.dropout)."""
    return 2 * INT32 * elements


def forward_only_casts(d: Dims) -> int:
    """Mixed precision: bf16 weight casts that autocast's cache holds until the forward ends but
    backward does not keep, since recompute makes them again: every block linear's under full,
    down_proj's under selective (made inside its checkpointed SwiGLU)."""
    if not d.mixed or d.recompute == "none":
        return 0
    per_layer = block_linears(d) if d.recompute in ("full", "op") else d.H * d.I_l
    if d.recompute == "full" and d.deferred:  # the column linears cast outside autocast's cache:
        # only o_proj's and down_proj's are held
        per_layer = sum(n for name, n in layer_params(d) if name.endswith(("o_proj", "down_proj")))
    return d.L * d.p * per_layer


def bias_casts(d: Dims) -> int:
    """Mixed precision with q/k/v biases: their bf16 casts, which autocast's cache holds until the
    forward ends (no backward saves a bias: its gradient is the output gradient's sum)."""
    return d.L * d.p * (d.Hq + 2 * d.Hkv) if d.mixed and d.bias else 0


def kv_widths(d: Dims) -> tuple[int, int]:
    """Widths of the k and v that attention saves. repeat_kv's expand + reshape copies them out to the
    query heads, unless this rank has one KV head: then the expanded size-1 dim merges into a
    stride-0 view and nothing is copied. SDPA saves that view; manual attention's matmuls reshape it
    to [B Nq, S, D], which copies it (and saves the copy) unless B is 1: a size-1 batch dim merges
    with the stride-0 head dim into a view. SDPA with model.fused_ops takes them at their own heads
    (enable_gqa): nothing repeated."""
    if d.flash and d.fused_ops:
        return d.Hkv, d.Hkv
    n_rep = d.Nq_l > d.Nkv_l
    v_width = d.Hq if n_rep and (d.Nkv_l > 1 or not d.flash and d.B > 1) else d.Hkv
    return v_width, v_width


def model_activations(d: Dims) -> dict[str, int]:
    """Bytes saved for backward outside the blocks, and the tensors the step holds all along. The
    logits are not here: the loss holds them while it runs (`loss_extra`), nothing after it."""
    N, Ns, H, p = d.N, d.Ns, d.H, d.p
    # the LM head's input: the shard under SP + VP with the re-gather (cast once under mixed
    # precision, as a region entry), else the whole [S, B, H] (the dense head's own cast, if mixed)
    head_input = p * (Ns if d.sp and d.vp and d.regather else N) * H
    return {
        "blocks": d.L * sum(layer_activations(d).values()),
        # VP: masked local ids (int64), out-of-range mask; DTensor's embedding saves its DTensor input,
        # the ids themselves (a view of the batch), and masks them again in backward
        "embedding": (INT64 + 1) * d.N if d.vp and not d.dtensor else 0,
        "embedding dropout": stream_mask(d),
        # cos, sin [S, D] fp32, built once and kept by the model. Where FSDP2 casts them at each block's
        # entry no op of the step takes them or a view of them, so MemTracker does not count them.
        # model.fused_ops: the tables made from them once, in p, which every block's RoPE takes as they
        # are: no op takes the fp32 ones nor makes a view of either, so neither is counted (2 S D (4 + p)
        # bytes, made at the first step and kept, which this model leaves out as MemTracker does)
        "rope tables": 0 if d.rope_cast_once or d.fused_ops else 2 * FP32 * d.S * d.D,
        "final norm": d.s * Ns * H if d.lean_rmsnorm else 2 * FP32 * Ns * H + FP32 * Ns,
        "head input": head_input,
        "head weight cast": p * d.V_l * H if d.mixed else 0,
        "batch": 2 * INT64 * d.B * d.dp * d.S,  # ids and labels of the global batch (sliced views)
    }


def recomputed(d: Dims) -> dict[str, int]:
    """What a block recomputed under full recompute saves while its backward runs, beyond its input:
    everything of `none`, the whole gathered region inputs included (the re-gather is off inside the
    blocks). A lean first norm keeps the block input, held already; so does a norm's fp32 copy of an
    fp32 stream (x.float() is x). FSDP2's cast cos and sin are the block's saved inputs: none again."""
    terms = layer_activations(replace(d, recompute="none", regather=False))
    if d.lean_rmsnorm or d.s == FP32:
        terms["input_layernorm"] -= d.s * d.Ns * d.H
    if d.rope_cast_once:
        terms["rope tables"] = 0
    return terms


def recomputing_own(d: Dims, recomputing: bool = False) -> int:
    """What a block whose backward recomputes holds of its own forward's keeps beyond what full
    recompute's moments count (its input, FSDP2's cast cos and sin): 0 under full. Under op, what its
    policy saved, less what the recomputation takes back into the block's graph (counted in
    `recomputed`) and, once the recomputation is over, nothing: while it runs (`recomputing`) the
    outputs after its early stop are still in the checkpoint's storage (down_proj's kept output, the
    MLP exit's collective), which the end of the recomputation lets go of (measured)."""
    if d.recompute != "op":
        return 0
    kept = op_kept(d)
    left = 0
    if recomputing:
        exit_tokens = op_exit_tokens(d)
        left = d.p * exit_tokens * d.H + (d.p * d.N * d.H if "down_proj" in op_kept_linears(d) else 0)
    return left - (sum(kept.values()) - kept["block input"] - kept["rope tables"])


def after_head(acts: dict[str, int]) -> int:
    """What the step still saves once the final norm's backward is done: the head's input and weight
    cast and the final norm's tensors are freed."""
    return sum(acts.values()) - acts["final norm"] - acts["head input"] - acts["head weight cast"]
