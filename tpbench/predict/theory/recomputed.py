"""The moments of a block whose backward recomputes its forward (train.recompute full or op): its
forward made again, at its softmax (manual attention), its attention dropout, its SwiGLU's product;
then its backward, at down_proj, in the SwiGLU's, at the post-attention norm. Under op, what the
policy kept and the recomputation has not yet taken back into the block's graph is still in the
checkpoint's storage (`kept_past_scores`, activations.recomputing_own).

Each takes the step's state as tpbench.predict.theory.blocks' moments do, and the block's `layer`
(the top and the bottom block are the candidates: the top one beside every block's input, the bottom
one beside most gradients).
"""

from __future__ import annotations

from dataclasses import replace

from tpbench.predict.theory.activations import (
    after_head,
    mask_bits,
    op_kept,
    op_kept_after_scores,
    recomputed,
    recomputing_own,
    stream_mask,
)
from tpbench.predict.theory.blocks import late_grads, unsaved_norm_output
from tpbench.predict.theory.dims import FP32, LOSS_AND_GRAD, Dims
from tpbench.predict.theory.moments import Moment
from tpbench.predict.theory.weights import layer_params


def recomputed_post_attention_norm(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full recompute: block `layer`'s post-attention RMSNorm backward, at pow's backward, as
    `post_attention_norm_backward` with the recomputed tensors (`recomputed`) in place of the saved
    ones: the MLP has run its backward (its gathered input, the SwiGLU's tensors and, mixed, its weight
    casts freed, its weight gradients made), 5 fp32 temporaries of the stream's shape (a sixth, the
    fp32 input made again, unless the stream is fp32). Without SP they are [S, B, H] each: at a real
    model's shape the block's largest moment. The blocks above have finished, as for
    `recomputed_block`."""
    saved = recomputed(d)
    freed = saved["mlp input"] + saved["swiglu"] + stream_mask(d)
    if d.mixed:
        freed += d.p * sum(n for name, n in layer_params(d) if name.startswith("mlp."))
    above, residual = d.L - 1 - layer, d.s * d.Ns * d.H  # the norm's input: a temporary (`recomputed_swiglu`)
    activations = after_head(acts) - above * (acts["blocks"] // d.L) + sum(saved.values()) - freed - residual
    activations += recomputing_own(d)
    temps = (6 if d.s != FP32 else 5) * FP32 * d.Ns * d.H + residual + (d.V_l * d.H * d.w if d.tied else 0)
    done: tuple[str, ...] = ("mlp.", "post_attention_layernorm")
    if d.s == FP32:  # an fp32 stream (mixed precision): at the peak the mean's [S, B, 1] fp32
        temps += FP32 * d.Ns  # gradient is alive and the norm's weight gradient not made yet
        done = ("mlp.",)
    grads = d.H + sum(n for name, n in layer_params(d) if name.startswith(done))
    grads += above * sum(n for _, n in layer_params(d)) + (0 if d.tied else d.V_l * d.H)
    grads = buckets + (grads * d.w if own_grads else late_grads(d, layer, done))
    name = f"recomputed post-attention norm {layer}"
    return Moment(name, P, grads, optim, activations + LOSS_AND_GRAD, temps)


def recomputed_attention_dropout(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full recompute with dropout: block `layer`'s forward run again in its backward, at its attention
    dropout's hash (as `attention_dropout`: the scores and the causal mask its locals, the softmax
    output saved, its cast, two int32 copies of the probabilities' shape). The MLP dropout's backward,
    the block's first, started the recomputation (its mask is the block's last save): what the
    recomputation has saved up to the attention core is alive, as are the stream's gradient (and
    its cast under mixed precision) and, as for `attention_backward`, what the blocks above left:
    their gradients, not their inputs."""
    saved = recomputed(d)
    scores = d.B * d.Nq_l * d.S * d.S
    above = d.L - 1 - layer
    later = saved["post_attention_layernorm"] + saved["mlp input"] + saved["swiglu"] + saved["attention core"]
    later += 2 * stream_mask(d)
    if d.mixed:  # o_proj's and the MLP's weight casts are not made again yet
        later += d.p * sum(n for name, n in layer_params(d) if name.startswith(("mlp.", "self_attn.o_proj")))
    activations = after_head(acts) - above * (acts["blocks"] // d.L) + sum(saved.values()) - later
    activations += kept_past_scores(d)
    activations += FP32 * scores + LOSS_AND_GRAD
    grads = d.H + above * sum(n for _, n in layer_params(d)) + (0 if d.tied else d.V_l * d.H)
    grads = buckets + (grads * d.w if own_grads else late_grads(d, layer, ()))
    cast = d.p * scores if d.p != FP32 else 0
    # the stream's gradient (mixed: and its bf16 cast for the MLP dropout, whose backward started this)
    flowing = d.s * d.Ns * d.H + (d.p * d.Ns * d.H if d.mixed else 0)
    temps = d.p * scores + cast + FP32 * d.S * d.S + mask_bits(scores) + flowing
    temps += unsaved_norm_output(d) + (d.V_l * d.H * d.w if d.tied else 0)
    return Moment(f"recomputed attention dropout {layer}", P, grads, optim, activations, temps)


def kept_past_scores(d: Dims) -> int:
    """Under op, a block whose recomputation is past manual attention's scores: what its policy kept
    beyond what full's moments count (its input, the rope tables), less what the recomputation has
    taken back into the block's graph by then: the outputs kept past the scores are still in the
    checkpoint's storage (`op_kept_after_scores`). 0 under full."""
    if d.recompute != "op":
        return 0
    kept = op_kept(d)
    return op_kept_after_scores(d) - (sum(kept.values()) - kept["block input"] - kept["rope tables"])


def recomputed_softmax(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full or op recompute with manual attention: block `layer`'s forward run again in its backward,
    at its softmax (as `attention_forward`: the scaled scores, their fp32 sum with the causal mask and
    the mask [S, S], the attention's locals, and the fp32 softmax output, which it saves). What the
    recomputation has saved up to the attention core is alive, as for `recomputed_attention_dropout`,
    and what started it: down_proj's backward (with dropout, the MLP dropout's), with the stream's
    gradient and down's output gradient as at `recomputed_swiglu`. Under op the outputs the policy kept
    past the scores are still in the checkpoint's storage (`op_kept_after_scores`); those before are
    back in the block's graph. MemTracker counts what the recomputation makes inside a module of the
    block as activations: the scores, their sum, the mask and the softmax output are (measured: the top
    block's, the peak at T 4 under VP, fp32, S 128)."""
    saved = recomputed(d)
    scores = d.B * d.Nq_l * d.S * d.S
    above = d.L - 1 - layer
    later = saved["post_attention_layernorm"] + saved["mlp input"] + saved["swiglu"] + saved["attention core"]
    later += 2 * stream_mask(d)
    if d.mixed:  # o_proj's and the MLP's weight casts are not made again yet
        later += d.p * sum(n for name, n in layer_params(d) if name.startswith(("mlp.", "self_attn.o_proj")))
    activations = after_head(acts) - above * (acts["blocks"] // d.L) + sum(saved.values()) - later
    activations += kept_past_scores(d)
    activations += d.p * scores + 2 * FP32 * scores + FP32 * d.S * d.S + LOSS_AND_GRAD
    grads = d.H + above * sum(n for _, n in layer_params(d)) + (0 if d.tied else d.V_l * d.H)
    grads = buckets + (grads * d.w if own_grads else late_grads(d, layer, ()))
    if d.dropout:  # the MLP dropout's backward started it (and, mixed, its cast of the gradient)
        flowing = d.s * d.Ns * d.H + (d.p * d.Ns * d.H if d.mixed else 0)
    else:
        flowing = d.s * d.Ns * d.H + (d.p * d.N * d.H if d.sp or d.mixed else 0)
    temps = flowing + unsaved_norm_output(d) + (d.V_l * d.H * d.w if d.tied else 0)
    return Moment(f"recomputed softmax {layer}", P, grads, optim, activations, temps)


def recomputed_block(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full recompute: block `layer`'s backward, in the SwiGLU's. Its forward has run again (to
    down_proj's input) and down_proj's backward is done: its input (and, mixed, its weight cast) is
    freed, its weight gradient made; three tensors of the SwiGLU's size are alive (the gradient of
    silu(gate) * up and, one after the other, two of grad * up, gate's gradient and up's), with the
    stream's gradient (fp32 under mixed precision, as the stream).
    The blocks above have finished: their inputs are freed, their gradients made, as are the head's
    and the final norm's (a tied head's waits, as a temporary, for the embedding's share). The top
    block holds the most activations, the bottom one the most gradients."""
    ffn = d.p * d.N * d.I_l
    above = d.L - 1 - layer
    block_input = acts["blocks"] // d.L
    activations = after_head(acts) - above * block_input
    activations += sum(recomputed(d).values()) - ffn - (d.p * d.H * d.I_l if d.mixed else 0)
    activations += recomputing_own(d)
    activations -= stream_mask(d)  # the MLP dropout's, whose backward ran first
    activations += LOSS_AND_GRAD
    block = sum(n for _, n in layer_params(d))
    grads = d.H + above * block + d.H * d.I_l + (0 if d.tied else d.V_l * d.H)
    tied_head = d.V_l * d.H * d.w if d.tied else 0
    temps = 3 * ffn + d.s * d.Ns * d.H + tied_head
    if d.recompute == "op":  # the residual sum the post-attention norm keeps: made between modules
        residual = d.s * d.Ns * d.H
        activations, temps = activations - residual, temps + residual
    grads = buckets + (grads * d.w if own_grads else late_grads(d, layer, ("mlp.down_proj",)))
    return Moment(f"recomputed block {layer}", P, grads, optim, activations, temps)


def recomputed_down_weight_cast(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full recompute under mixed precision: block `layer`'s down_proj weight gradient cast to fp32
    (its cast's backward), as `down_backward`'s second moment: down's matmul has let go of its input
    (the recomputed product), its weight cast and the bf16 gradient of its output; the fp32 weight
    gradient lives beside the bf16 one."""
    down = recomputed_down_backward(d, acts, P, optim, buckets, own_grads, layer)
    weight = d.I_l * d.H
    freed = d.p * d.N * d.I_l + d.p * weight
    return replace(
        down,
        name=f"recomputed down_proj weight cast's backward {layer}",
        activations=down.activations - freed,
        temporaries=down.temporaries - d.p * d.N * d.H + d.w * weight,
    )


def recomputed_swiglu(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full recompute: block `layer`'s forward made again in its backward, at its SwiGLU's product
    (silu(gate) is made, then silu(gate) * up beside it: 4 tensors of the SwiGLU's size at once, gate,
    up and the product saved). The blocks above have finished, as for `recomputed_block`.
    What the recomputation has saved up to there is alive: all of `recomputed` but down_proj's weight
    cast (mixed) and the MLP dropout's mask. So are what its forward holds without saving it, the
    post-attention norm's output that the MLP region's entry gathered or cast (`unsaved_norm_output`),
    and what started the recomputation: down_proj's backward, with the stream's gradient and down's
    output gradient (SP's all-gathered one, or under mixed precision its bf16 cast); with dropout, the MLP
    dropout's backward, before those (as `recomputed_attention_dropout`). A tied head's gradient waits
    (a temporary) for the embedding's share.
    The split follows MemTracker's: a tensor the recomputation makes is an activation while one of the
    block's modules runs its forward (a module's pre-forward hook marks it, its post-forward hook
    unmarks it), a temporary otherwise. So silu(gate) and the norm's output count as activations, and
    the residual sum the post-attention norm keeps (recompute needs the lean norm), made by the block
    itself between its modules, as a temporary."""
    ffn = d.p * d.N * d.I_l
    above = d.L - 1 - layer
    saved = sum(recomputed(d).values()) - stream_mask(d) - (d.p * d.H * d.I_l if d.mixed else 0)
    residual = d.s * d.Ns * d.H
    activations = after_head(acts) - above * (acts["blocks"] // d.L) + saved + LOSS_AND_GRAD
    activations += recomputing_own(d, recomputing=True)
    activations += ffn + unsaved_norm_output(d) - residual
    if d.dropout:
        flowing = d.s * d.Ns * d.H + (d.p * d.Ns * d.H if d.mixed else 0)
    else:
        # down's output gradient: SP's all-gathered [N, H] (of a cast shard, freed, under mixed), else
        # under mixed precision the stream's gradient cast to bf16
        flowing = d.s * d.Ns * d.H + (d.p * d.N * d.H if d.sp or d.mixed else 0)
    temps = residual + flowing + (d.V_l * d.H * d.w if d.tied else 0)
    grads = d.H + above * sum(n for _, n in layer_params(d)) + (0 if d.tied else d.V_l * d.H)
    grads = buckets + (grads * d.w if own_grads else late_grads(d, layer, ()))
    return Moment(f"recomputed swiglu {layer}", P, grads, optim, activations, temps)


def recomputed_down_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full recompute: block `layer`'s down_proj backward, right after its forward was made again
    (`recomputed_swiglu`), inside the matmul's backward: down's input gradient [N, I/T] and weight
    gradient [H, I/T] made beside everything the recomputation holds. Since the SwiGLU's moment its
    fourth tensor is gone, down's weight cast (mixed precision) saved, and what the region's forward
    held without saving (`unsaved_norm_output`) freed with its end."""
    swiglu = recomputed_swiglu(d, acts, P, optim, buckets, own_grads, layer)
    freed = d.p * d.N * d.I_l - (d.p * d.H * d.I_l if d.mixed else 0) + unsaved_norm_output(d)
    freed += recomputing_own(d, recomputing=True) - recomputing_own(d)  # op: the storage let go
    made = d.p * d.N * d.I_l + d.p * d.I_l * d.H
    return replace(
        swiglu,
        name=f"recomputed down_proj backward {layer}",
        activations=swiglu.activations - freed,
        temporaries=swiglu.temporaries + made,
    )
