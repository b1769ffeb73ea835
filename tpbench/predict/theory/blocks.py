"""The moments inside the model where the peak can fall: the top block's manual-attention softmax in
forward, then backward from the final norm down through the top block (down_proj, SwiGLU, gate_proj,
the post-attention norm, k_norm and q_norm, the attention's softmax), and under full recompute the
top and the bottom block's recomputed backward.

Each takes the step's state (P parameter bytes, `optim` AdamW's, DDP's `buckets`, whether backward
makes gradients of its own: `own_grads`) and the model's saved activations (`acts`,
`model_activations`), and says what is freed, made and alive at its moment.
"""

from __future__ import annotations

from dataclasses import replace

from tpbench.predict.theory.activations import (
    after_head,
    bias_casts,
    forward_only_casts,
    kv_widths,
    layer_activations,
    mask_bits,
    model_activations,
    op_kept,
    probs_saved,
    recomputed,
    recomputing_own,
    stream_mask,
)
from tpbench.predict.theory.dims import FP32, LOSS_AND_GRAD, Dims
from tpbench.predict.theory.moments import Moment
from tpbench.predict.theory.weights import late_params, layer_params, params


def attention_forward(d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int) -> Moment:
    """The top block's manual-attention forward, at its softmax: the scores [B, Nq, S, S] (p, a local
    of the forward until it returns), their fp32 sum with the causal mask, the fp32 softmax output
    (saved) and the mask [S, S] itself. Under SP with the re-gather the gathered region input is alive
    too (only its shard stays saved; a column linear's own gathered input, parallel.sp_gather=linear,
    is freed once it returns); under mixed precision the input norm's fp32 output, which the region's
    forward holds while its linears keep their bf16 cast (measured with dropout, whose moment is this
    one's). The top block's MLP, o_proj and final norm have not run yet."""
    layer = layer_activations(d)
    scores = d.B * d.Nq_l * d.S * d.S
    later = layer["post_attention_layernorm"] + layer["mlp input"] + layer["swiglu"] + layer["attention core"]
    later += 2 * stream_mask(d)  # the dropouts after o_proj and down_proj
    if d.mixed:  # o_proj's and the MLP's weight casts are not made yet
        later += d.p * sum(n for name, n in layer_params(d) if name.startswith(("mlp.", "self_attn.o_proj")))
    gathered = d.p * d.N * d.H if d.sp and d.block_regather and not d.per_linear else 0
    temps = d.p * scores + FP32 * scores + FP32 * d.S * d.S + gathered + unsaved_norm_output(d)
    activations = after_head(acts) - later + FP32 * scores + bias_casts(d)
    return Moment("attention forward", P, buckets, optim, activations + temps, 0)


def op_attention_forward(d: Dims, P: int, optim: int, buckets: int) -> Moment:
    """Recompute op: the top block's manual-attention forward at its softmax, as without recompute
    (`attention_forward`, the re-gather off as under op) but for what the blocks below keep (their
    policy's outputs, `op_kept`, for everything `none` saves) and Q K^T's output, which the policy keeps
    beside the scaled scores made from it (without recompute it is freed once they are made). Under
    mixed precision the blocks below hold their weight casts still, in autocast's cache."""
    plain = replace(d, recompute="none", regather=False)
    moment = attention_forward(plain, model_activations(plain), P, optim, buckets)
    held = sum(op_kept(d).values()) + forward_only_casts(d) // d.L  # mixed: autocast's cached casts
    below = (d.L - 1) * (held - sum(layer_activations(plain).values()))
    scores = d.p * d.B * d.Nq_l * d.S * d.S
    return replace(moment, activations=moment.activations + below + scores)


def unsaved_norm_output(d: Dims) -> int:
    """The input norm's output that the attention region's forward holds without its linears keeping
    it: its fp32 result under mixed precision (they keep the bf16 cast), and under SP without the
    re-gather (full recompute included) the shard that was gathered (they keep the whole)."""
    fp32 = FP32 * d.Ns * d.H if d.mixed else 0
    return fp32 + (d.p * d.Ns * d.H if d.sp and not d.block_regather else 0)


def prefetched_input(d: Dims, linears: int) -> int:
    """Overlap with SP's re-gather: a region's input gathered again from the region's exit backward on
    (tpbench.parallel.overlap starts it there, to hide behind the region's backward), so alive through
    all of that backward, [N, H]: once, or under parallel.sp_gather=linear once for each of the region's
    `linears` column linears. Without overlap it is gathered when the first linear's backward needs it
    (`mlp_backward`, `head_norm_backward`)."""
    if not (d.overlap and d.sp and d.block_regather):
        return 0
    return d.p * d.N * d.H * (linears if d.per_linear else 1)


def attention_dropout(d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int) -> Moment:
    """model.dropout: the top block's attention-probability dropout drawing its mask, in its hash's
    last fold (two int32 copies of the probabilities' shape: tpbench.models.dropout). As at the
    softmax (`attention_forward`), but the fp32 sum is freed, the softmax output (saved) and its cast
    (unless fp32) are made; the scores and the causal mask are the forward's locals still."""
    at_softmax = attention_forward(d, acts, P, optim, buckets)
    scores = d.B * d.Nq_l * d.S * d.S
    cast = d.p * scores if d.p != FP32 else 0
    total = at_softmax.activations - FP32 * scores + cast + mask_bits(scores)
    return Moment("attention dropout", P, buckets, optim, total, 0)


def final_norm_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The final RMSNorm's backward. MiniMind's RMSNorm computes in fp32, and its backward (pow's,
    mean's and mul's gradients and their sum) holds 5 fp32 [Ns, H] temporaries at once beside its
    saved fp32 input (as measured: docs/theory.md, "How the model is checked"). The loss and the head
    have run their backward: their saved tensors are freed, the head's gradient made (a tied head's waits,
    as a temporary, for the embedding's share); the norm's weight gradient is made too.
    A lean norm has made its fp32 copy of the input again (unless the input is fp32: x.float() is x),
    and its normed result and rsqrt, which are freed by then as they are without it."""
    freed = acts["head input"] + acts["head weight cast"]
    if not d.lean_rmsnorm:
        freed += FP32 * d.Ns * d.H + FP32 * d.Ns  # normed, rsqrt
    elif d.s != FP32:
        freed -= FP32 * d.Ns * d.H  # the fp32 copy, made again
    grads = d.H + (0 if d.tied else d.V_l * d.H)
    tied_head = d.V_l * d.H * d.w if d.tied else 0
    temps = 5 * FP32 * d.Ns * d.H + tied_head
    grads = buckets + (grads * d.w if own_grads else late_grads(d, d.L - 1, ()))
    activations = sum(acts.values()) - freed + LOSS_AND_GRAD
    return Moment("final norm backward", P, grads, optim, activations, temps)


def top_block_grads(d: Dims, done: tuple[str, ...] | list[str], buckets: int, own_grads: bool) -> int:
    """Gradient bytes once the top block's `done` parameters have run their backward: theirs, the final
    norm's and an untied head's (a tied head's waits, as a temporary, for the embedding's share),
    beside DDP's buckets."""
    done_params = sum(n for name, n in layer_params(d) if name.removesuffix(".bias") in done)
    grads = d.H + done_params + (0 if d.tied else d.V_l * d.H)
    return buckets + (grads * d.w if own_grads else late_grads(d, d.L - 1, done))


def late_grads(d: Dims, layer: int, done: tuple[str, ...] | list[str]) -> int:
    """Under megatron's flat DP buckets (`Dims.flat_dp`) the late gradients (weights.late_params: the
    q/k norms', SP's norms', KV replicas') stay autograd's own to the end of backward, beside the
    buckets: the bytes of those made by now, the final norm's, those of the blocks above `layer`, and
    of block `layer` those whose name (or a prefix ending in ".") is in `done`."""
    if not d.flat_dp:
        return 0
    prefixes = tuple(p for p in done if p.endswith("."))

    def made(name: str) -> bool:
        if not name.startswith("model.layers."):
            return name == "model.norm"
        i, leaf = name.split(".", 3)[2:]
        mine = int(i) == layer and (leaf.removesuffix(".bias") in done or leaf.startswith(prefixes))
        return int(i) > layer or mine

    late = late_params(d)
    return sum(n for name, n in params(d) if name in late and made(name)) * d.w


def down_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> list[Moment]:
    """The top block's down_proj backward, the block's first, inside its matmul's backward: down's
    input gradient [N, I/T] and weight gradient [H, I/T] made, in the matmul's dtype, beside all the
    step still saves (down's input, and its weight cast under mixed precision, among it). Alive with
    them: the incoming gradient, the stream's ([Ns, H], in its dtype; mixed, also its cast for down's
    bf16 output; under SP, g-bar's all-gathered [N, H]) and a tied head's gradient, waiting (a
    temporary) for the embedding's share. Under mixed precision the weight gradient is then cast to
    fp32 for the master weight's .grad, in the cast's backward: down's matmul has let go of its input,
    its weight cast and the cast gradient of its output, and the fp32 weight gradient lives beside the
    bf16 one. Few tokens beside an H x I weight (small S) make either the peak. Selective recompute
    has made down's input (and weight cast) again for it, as full recompute does the block's."""
    ffn, weight = d.p * d.N * d.I_l, d.I_l * d.H
    incoming = d.s * d.Ns * d.H + (d.p * d.N * d.H if d.sp else 0)
    if d.dropout and not d.mixed and not d.sp:  # the MLP dropout's input gradient, down's to take
        incoming += d.p * d.N * d.H
    temps = ffn + d.p * weight + incoming + (d.V_l * d.H * d.w if d.tied else 0) + prefetched_input(d, 2)
    grads = top_block_grads(d, (), buckets, own_grads)
    activations = after_head(acts) + LOSS_AND_GRAD - stream_mask(d)  # the MLP dropout's backward ran
    if d.recompute == "selective":  # down's input (and weight cast) made again, not kept from forward
        activations += ffn + (d.p * weight if d.mixed else 0)
    cast_grad = d.p * d.N * d.H if d.mixed and not d.sp else 0  # SP: the cast shard, gathered
    out = [Moment("down_proj backward", P, grads, optim, activations, temps + cast_grad)]
    if d.mixed:
        freed = ffn + d.p * weight
        gathered = d.p * d.N * d.H if d.sp else 0  # SP: g-bar's gathered gradient, down's, freed too
        cast = Moment(
            "down_proj weight cast's backward",
            P,
            grads,
            optim,
            activations - freed,
            temps - gathered + d.w * weight,
        )
        out.append(cast)
    return out


def swiglu_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The top block's SwiGLU backward, at silu's backward: down_proj's backward is done (its input,
    the SwiGLU's product, is freed, as is its weight cast under mixed precision; selective recompute
    made both again and freed them there), its weight gradient made. Alive: three tensors of the
    SwiGLU's size (the product's gradient, its product with up, silu's backward being made; MiniMind's
    unfused ops: the two products and silu's backward), the stream's gradient, and a tied head's
    gradient, waiting (a temporary) for the embedding's share. The fused SwiGLU still keeps gate and
    up, MiniMind's ops gate alone (mul's saved silu(gate) and up are freed once its backward ran)."""
    ffn = d.p * d.N * d.I_l
    freed = layer_activations(d)["swiglu"] - (2 if d.fused_swiglu else 1) * ffn + stream_mask(d)
    if d.mixed and d.recompute == "none":
        freed += d.p * d.I_l * d.H  # down's weight cast
    done = ("mlp.down_proj",)
    temps = 3 * ffn + d.s * d.Ns * d.H + (d.V_l * d.H * d.w if d.tied else 0) + prefetched_input(d, 2)
    grads = top_block_grads(d, done, buckets, own_grads)
    return Moment("swiglu backward", P, grads, optim, after_head(acts) - freed + LOSS_AND_GRAD, temps)


def mlp_backward(d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool) -> Moment:
    """The top block's SwiGLU backward, at gate_proj's weight gradient (the MLP's last matmul in
    backward: up_proj's runs first). Down's and up's backward are done: the SwiGLU's saved tensors are
    freed (mixed: down's and up's weight casts too, and up's own cast of the input where each linear
    casts its own), their weight gradients made. Alive: gate's gradient [N, I/T], up's and gate's
    input gradients [N, H] (summed once gate's backward ends; under SP's per-linear gathers up's own
    linear has reduce-scattered its own already: [Ns, H]), gate's weight gradient being made, the
    stream's gradient, SP's re-gathered MLP input, and a tied head's gradient, waiting (a temporary)
    for the embedding's share. The MLP input itself is still saved: gate's backward reads it."""
    layer = layer_activations(d)
    freed = layer["swiglu"] + stream_mask(d)  # with the MLP dropout's mask
    if d.mixed:
        freed += d.p * d.I_l * d.H * (2 if d.recompute == "none" else 1)  # up's (selective: down's is remade)
        freed += 0 if d.cast_once else d.p * d.N * d.H
    done = ("mlp.down_proj", "mlp.up_proj")
    inputs = d.p * (d.N + (d.Ns if d.per_linear else d.N)) * d.H  # gate's and up's input gradients
    temps = d.p * d.N * d.I_l + inputs + d.p * d.I_l * d.H + d.s * d.Ns * d.H
    temps += (d.V_l * d.H * d.w if d.tied else 0) + (d.p * d.N * d.H if d.sp and d.block_regather else 0)
    grads = top_block_grads(d, done, buckets, own_grads)
    return Moment("mlp backward", P, grads, optim, after_head(acts) - freed + LOSS_AND_GRAD, temps)


def post_attention_norm_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The top block's post-attention RMSNorm backward, at pow's backward: 5 fp32 temporaries of the
    stream's shape, the stream's gradient among them (as the final norm's), and a sixth where a lean
    norm has made its fp32 input again (unless the stream is fp32); where the stream is not fp32 the
    block's output gradient too, in its dtype, waiting for the residual sum (in fp32 it is the one
    among the 5). The MLP has run its backward: its input, the SwiGLU's tensors (and, mixed, its
    weight casts) are freed, its weight gradients made."""
    layer = layer_activations(d)
    freed = layer["mlp input"] + layer["swiglu"] + stream_mask(d)  # with the MLP dropout's mask
    if d.mixed:
        freed += d.p * sum(n for name, n in layer_params(d) if name.startswith("mlp."))
        freed -= forward_only_casts(d) // d.L  # selective: down's cast was never kept
    if not d.lean_rmsnorm:  # its normed result and rsqrt
        freed += FP32 * d.Ns * d.H + FP32 * d.Ns
    temps = (6 if d.lean_rmsnorm and d.s != FP32 else 5) * FP32 * d.Ns * d.H
    temps += d.s * d.Ns * d.H if d.s != FP32 else 0
    temps += d.V_l * d.H * d.w if d.tied else 0
    done = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"]
    grads = top_block_grads(d, done, buckets, own_grads)
    activations = after_head(acts) - freed + LOSS_AND_GRAD
    return Moment("post-attention norm backward", P, grads, optim, activations, temps)


def head_norm_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, norm: str
) -> Moment:
    """The top block's k_norm or q_norm backward, at pow's backward (as the final norm's, 5 fp32
    temporaries of its input's shape beside its fp32 input, which a lean norm has made again: a sixth
    unless the input is fp32). Autograd runs the attention's branches latest-made first: both RoPEs,
    v_proj (its input gradient waits, [N, H], beside SP's re-gathered input), then k_norm, q_norm, and
    only then k_proj and q_proj. The block's MLP, post-attention norm, o_proj, attention core, RoPE
    tables and v_proj have run their backward and freed what they saved; the norms keep their inputs
    until theirs. At k_norm's, q_norm's incoming gradient waits; at q_norm's, k_norm's result, the
    gradient of k_proj's output [N, Hkv], waits for k_proj, whose weight gradient is not made yet."""
    layer = layer_activations(d)
    width = d.Hkv if norm == "k_norm" else d.Hq
    freed = sum(layer[k] for k in ("post_attention_layernorm", "mlp input", "swiglu", "attention core"))
    freed += layer["q, k, v"] + layer["rope tables"] + 2 * stream_mask(d)  # and both stream dropouts'
    done = ["self_attn.o_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    done += ["post_attention_layernorm", f"self_attn.{norm}"]  # its weight's gradient precedes pow's
    if norm == "q_norm":  # k_norm has run its backward, k_proj not yet
        freed += layer["k_norm"]
        done += ["self_attn.k_norm"]
    if d.mixed:  # the weight casts of the linears that ran their backward
        pending = ("self_attn.q_proj", "self_attn.k_proj")
        freed += layer["weight casts"] - d.p * sum(
            n for name, n in layer_params(d) if name in pending and name not in done
        )
    own_input = (d.mixed and not d.cast_once) or (d.per_linear and not d.block_regather)
    if own_input:  # each linear's own copy of the input: v's freed
        freed += d.p * d.N * d.H
    if not d.lean_rmsnorm:  # the running norm's normed result and rsqrt are freed
        freed += FP32 * d.N * width + FP32 * d.N * width // d.D
    norm_temps = (6 if d.lean_rmsnorm and d.p != FP32 else 5) * FP32 * d.N * width
    temps = norm_temps + d.s * d.Ns * d.H + d.p * d.N * d.H  # stream's and the attention input's gradients
    if norm == "k_norm":
        temps += d.p * d.N * d.Hq  # q_norm's incoming gradient
    else:
        temps += d.p * d.N * d.Hkv  # k_norm's result gradient, k_proj's to take
    if d.sp and d.block_regather and not d.per_linear:
        temps += d.p * d.N * d.H  # the re-gathered attention input
    temps += d.V_l * d.H * d.w if d.tied else 0
    grads = top_block_grads(d, done, buckets, own_grads)
    return Moment(f"{norm} backward", P, grads, optim, after_head(acts) - freed + LOSS_AND_GRAD, temps)


def attention_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Block `layer`'s manual-attention backward, at softmax's backward: the fp32 softmax output
    (saved), the fp32 gradient of the probabilities and the fp32 result, 3 x 4 B Nq S^2 at once.
    By then the head, the final norm, the MLP and o_proj have run their backward: their saved
    tensors are freed (mixed: their weight casts too) and their gradients made. A tied LM head's
    gradient waits, as a temporary, for the embedding's share. Also alive: the residual stream's
    gradient (fp32 under mixed precision, as the stream) and v's (its node runs later).
    Without full recompute, `layer` is the top block. Under full recompute its activations are the
    recomputed ones, and, as for `recomputed_block`, the blocks above have finished (their inputs
    freed, their gradients made): the top block holds the most activations, the bottom one the most
    gradients (mixed precision: fp32 gradients beside bf16 activations)."""
    full = d.recompute in ("full", "op")
    saved = recomputed(d) if full else layer_activations(d)
    scores = d.B * d.Nq_l * d.S * d.S
    v_width = kv_widths(d)[1]
    freed = saved["post_attention_layernorm"] + saved["mlp input"] + saved["swiglu"] + 2 * stream_mask(d)
    freed += probs_saved(d) * scores + d.p * d.N * (d.Hq + v_width)  # probs (dropped), o in, v
    done = ["mlp.", "post_attention_layernorm", "self_attn.o_proj"]
    if d.mixed:  # the weight casts of o_proj and the MLP (selective remakes down's: not kept)
        freed += d.p * sum(n for name, n in layer_params(d) if name.startswith(("mlp.", "self_attn.o_proj")))
        freed -= d.p * d.H * d.I_l if d.recompute == "selective" else 0
    above = d.L - 1 - layer
    grads = d.H + sum(n for name, n in layer_params(d) if name.startswith(tuple(done)))
    grads += above * sum(n for _, n in layer_params(d)) + (0 if d.tied else d.V_l * d.H)
    tied_head = d.V_l * d.H * d.w if d.tied else 0
    flowing = d.s * d.Ns * d.H + d.p * d.N * v_width + prefetched_input(d, 3)
    grads = buckets + (grads * d.w if own_grads else late_grads(d, layer, done))
    activations = after_head(acts) - above * (acts["blocks"] // d.L) - freed + LOSS_AND_GRAD
    activations += sum(saved.values()) + recomputing_own(d) if full else 0
    name = f"recomputed attention {layer}" if full else "attention"
    return Moment(name, P, grads, optim, activations, 2 * FP32 * scores + tied_head + flowing)
