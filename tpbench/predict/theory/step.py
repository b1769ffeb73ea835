"""The moments of one training step in order, each a `Moment` (tpbench.predict.theory.moments):
  zero_grad(set_to_none) -> forward -> loss -> backward -> gradient sums -> clipping -> AdamW step.
The peak is the largest of them; docs/theory.md, "The moments of a step", lists them.
"""

from __future__ import annotations

from dataclasses import replace

from tpbench.predict.theory import blocks, entries, recomputed, weights
from tpbench.predict.theory.activations import bias_casts, forward_only_casts, model_activations
from tpbench.predict.theory.dims import FP32, LOSS_AND_GRAD, Dims
from tpbench.predict.theory.moments import (
    Moment,
    dtensor_loss_backward,
    dtensor_loss_forward,
    loss_backward,
    loss_extra,
    loss_forward,
)


def moments(d: Dims) -> list[Moment]:
    """Every moment of the step where the peak can fall, in the step's order."""
    P, O = weights.param_bytes(d), weights.optimizer_bytes(d)  # noqa: E741
    buckets, G = weights.bucket_bytes(d), weights.grad_bytes(d)
    acts = model_activations(d)
    A = sum(acts.values())
    # what outlives the backward: the batch, the model's RoPE tables and the loss the step returns
    kept = acts["batch"] + acts["rope tables"] + FP32

    loss_act, loss_temp = loss_extra(d)
    casts = forward_only_casts(d) + bias_casts(d)  # autocast's cache holds them to the forward's end
    if d.vp and d.dtensor and not d.logits_mean:  # loss_parallel: its forward (casts held), its backward
        back_act, back_temp = dtensor_loss_backward(d)
        out = [
            Moment("loss", P, buckets, O, A + casts + dtensor_loss_forward(d), 0),
            Moment("loss backward", P, buckets, O, A + back_act, back_temp),
        ]
    elif d.vp and not d.logits_mean:  # the vocab-parallel loss: its forward (casts held), its backward
        back_act, back_temp = loss_backward(d)
        out = [
            Moment("loss", P, buckets, O, A + casts + loss_act, loss_temp),
            Moment("loss backward", P, buckets, O, A + back_act, back_temp),
        ]
    else:  # the dense losses peak in their backward, the casts gone; their forward, beside the casts
        out = [Moment("loss", P, buckets, O, A + loss_act, loss_temp)]
        if d.mixed and (d.recompute != "none" or d.bias):  # the casts exist (for any sizes: depth.py)
            out.append(Moment("loss forward", P, buckets, O, A + casts + loss_forward(d), 0))

    # the LM head's backward: the logits' gradient, the head's weight gradient (not yet accumulated
    # into .grad; in the matmul's dtype: under mixed precision the bf16 weight cast's, cast to fp32
    # once the logits' gradient is freed) and its input gradient, with every activation still saved
    temp = d.p * d.N * d.V_l + d.V_l * d.H * d.p + d.p * d.N * d.H
    if d.sp and d.vp and d.regather:  # the head's input, all-gathered again
        temp += d.p * d.N * d.H
    head = A + LOSS_AND_GRAD
    if d.vp and not d.logits_mean:  # the vocab-parallel loss made the logits' gradient in place of the
        head, temp = head + d.p * d.N * d.V_l, temp - d.p * d.N * d.V_l  # logits: an activation still
    out.append(Moment("head backward", P, buckets, O, head, temp))
    if d.overlap and d.vp and d.mixed:  # the head's weight gradient deferred to its entry's backward
        # (tpbench.parallel.overlap): made there in bf16 and cast to fp32 while the logits' gradient
        # (which it is made from) and the rest of the head's backward are live, its bf16 weight cast gone
        # (without SP the entry's all-reduce runs on a clone of the input gradient, both alive)
        cast = head - acts["head weight cast"]
        clone = 0 if d.sp else d.p * d.N * d.H
        out.append(Moment("head entry backward", P, buckets, O, cast, temp + d.V_l * d.H * d.w + clone))
    if d.mixed:  # the head's weight gradient cast to fp32, beside its bf16 one and the input's gradient
        after = A - acts["head input"] - acts["head weight cast"] + LOSS_AND_GRAD
        cast = d.V_l * d.H * (d.p + d.w) + d.s * d.N * d.H
        out.append(Moment("head weight cast's backward", P, buckets, O, after, cast))
    out.append(blocks.final_norm_backward(d, acts, P, O, buckets, G > 0))
    if d.recompute in ("full", "op"):
        for i in sorted({d.L - 1, 0}):
            out.append(recomputed.recomputed_swiglu(d, acts, P, O, buckets, G > 0, i))
            out.append(recomputed.recomputed_down_backward(d, acts, P, O, buckets, G > 0, i))
            if d.mixed:
                out.append(recomputed.recomputed_down_weight_cast(d, acts, P, O, buckets, G > 0, i))
            out.append(recomputed.recomputed_block(d, acts, P, O, buckets, G > 0, i))
            if d.deferred:
                out.append(entries.recomputed_mlp_entry_backward(d, acts, P, O, buckets, G > 0, i))
            out.append(recomputed.recomputed_post_attention_norm(d, acts, P, O, buckets, G > 0, i))
    else:
        out += blocks.down_backward(d, acts, P, O, buckets, G > 0)
        out.append(blocks.swiglu_backward(d, acts, P, O, buckets, G > 0))
        out.append(blocks.post_attention_norm_backward(d, acts, P, O, buckets, G > 0))
        if d.qk_norm:
            out += [blocks.head_norm_backward(d, acts, P, O, buckets, G > 0, n) for n in ("k_norm", "q_norm")]
        out.append(blocks.mlp_backward(d, acts, P, O, buckets, G > 0))
        if d.deferred:
            out.append(entries.mlp_entry_backward(d, acts, P, O, buckets, G > 0))
    if not d.flash and d.recompute not in ("full", "op"):
        out.append(blocks.attention_forward(d, acts, P, O, buckets))
        if d.dropout:
            out.append(blocks.attention_dropout(d, acts, P, O, buckets))
        out.append(blocks.attention_backward(d, acts, P, O, buckets, G > 0, d.L - 1))
    elif not d.flash:
        if d.recompute == "op":
            out.append(blocks.op_attention_forward(d, P, O, buckets))
        out += [blocks.attention_backward(d, acts, P, O, buckets, G > 0, i) for i in sorted({d.L - 1, 0})]
        out += [recomputed.recomputed_softmax(d, acts, P, O, buckets, G > 0, i) for i in sorted({d.L - 1, 0})]
        if d.dropout:
            layers = sorted({d.L - 1, 0})
            out += [recomputed.recomputed_attention_dropout(d, acts, P, O, buckets, G > 0, i) for i in layers]

    # the embedding's backward makes its gradient from the stream's [S, B, H] gradient (gathered whole
    # under SP); the vocab-parallel one's masked ids ([S, B] int64, strided as the transposed batch)
    # are copied contiguous there
    embedding_temps = d.V_l * d.H * d.w + d.s * d.N * d.H + (8 * d.N if d.vp else 0)
    # DTensor's vocab-parallel embedding takes its gradient Replicate: the whole vocab's [V, H] on every
    # rank (its input and its output's gradient are whole), sliced to Shard(0) by finish_grads
    full_vocab = d.V * d.H * d.w if d.dtensor and d.vp else 0
    if full_vocab:
        embedding_temps += full_vocab - d.V_l * d.H * d.w - 8 * d.N
    if d.tied and d.overlap and d.vp:  # the head's weight gradient, deferred to its entry's backward
        # (tpbench.parallel.overlap), is .grad before the embedding's backward, which adds its own
        # into it in place: every gradient held, the embedding's being made (as untied). Under the
        # flat DP buckets the tied weight is a late one: that .grad, set by the entry and not by
        # autograd's accumulation, is a temporary to MemTracker until the gradient sums
        own, temps = G, embedding_temps
        if d.flat_dp:
            own, temps = weights.late_grad_bytes(d), embedding_temps + d.V_l * d.H * d.w
        out.append(Moment("backward end", P, buckets + own, O, kept + LOSS_AND_GRAD - FP32, temps))
    elif d.tied:  # the LM head's gradient waits for the embedding's; the two are summed into a third
        E = d.V_l * d.H * d.w
        own = G - E if G else weights.late_grad_bytes(d)
        temps = 3 * E + full_vocab
        out.append(Moment("backward end", P, buckets + own, O, kept + LOSS_AND_GRAD - FP32, temps))
    else:  # the embedding's backward, every other gradient made; the fused AdamW's moment is below it
        E = d.V_l * d.H * d.w
        own = G - E if G else weights.late_grad_bytes(d)
        out.append(
            Moment("embedding backward", P, buckets + own, O, kept + LOSS_AND_GRAD - FP32, embedding_temps)
        )
    # DTensor's finish_grads redistributes the Partial gradients (q/k norms; the norms under SP) to
    # Replicate and, under VP, the embedding's whole-vocab one to Shard(0): new tensors, made after
    # backward, which MemTracker counts as activations from then on
    moved = weights.redistributed_grad_bytes(d) if G else 0
    if full_vocab and G:  # the embedding's first (module order): its [V, H] and the slice it keeps
        E = d.V_l * d.H * d.w
        out.append(Moment("embedding gradient slice", P, buckets + G - E + full_vocab, O, kept + E, 0))
    if d.dp > 1 and not d.ddp and not d.flat_dp:  # megatron's blocking DP sum: one flat copy of all
        # (DTensor's finish_grads runs after backward: MemTracker counts its flat copy an activation)
        flat, temp = (P, 0) if d.dtensor else (0, P)
        out.append(Moment("gradient sums", P, buckets + G - moved, O, kept + moved + flat, temp))
    if d.grad_clip:  # tpbench.parallel.clip's global norm: one fp32 norm per gradient on every rank
        # (an empty one where it counts none) and their stack, every gradient and moment held
        clip = 2 * FP32 * len(weights.params(d))
        out.append(Moment("gradient clipping", P, buckets + G - moved, O, kept + moved, clip))
    # AdamW's temporaries count as optimizer bytes, as MemTracker counts every tensor made inside
    # optimizer.step (its Optstate), so that the split agrees with the measurement's, not the total alone
    adam_temp = weights.optimizer_temporaries(d)
    out.append(Moment("optimizer", P, buckets + G - moved, O + adam_temp, kept + moved, 0))
    return kept_output(d, acts, out) if d.keep_output else out


def kept_output(d: Dims, acts: dict[str, int], out: list[Moment]) -> list[Moment]:
    """train.keep_output: the step holds the model's output to its end, as the seed's and
    minimind-tron's benchmarks hold `output`: the logits [S, B, V/T] (p) and the final hidden states
    (the decoder's output: whole, or this rank's shard under SP with VP or DTensor's, whose head gathers
    it; in
    the stream's dtype, fp32 under mixed precision). Where the LM head saves that very tensor (pure
    precision; under SP with VP, with the re-gather) it is held from the head's backward on, which would
    free it; otherwise (the head saves its own cast, or its own gathered copy) from the forward on.
    The logits are held at every moment after the forward; at the loss, the dense loss's peak is its
    backward, where the logits would be gone (cross entropy), or the mean's gradient in fp32 and its
    cast (logits_mean): held beside them. (The vocab-parallel cross entropy turns the logits into their
    gradient in place: compose refuses keep_output with it.)"""
    logits = d.p * d.N * d.V_l
    # the decoder's output is this rank's shard under SP where the head gathers it itself: with VP, or
    # always under DTensor, whose LM head's PrepareModuleInput gathers it (its own copy, saved)
    shard = d.sp and (d.vp or d.dtensor)
    hidden = d.s * (d.Ns if shard else d.N) * d.H
    early = hidden if d.mixed or (shard and not d.regather) else 0
    held = {"attention forward": 0, "attention dropout": 0}
    held |= {"loss": logits + early, "head backward": logits + early}
    return [replace(m, activations=m.activations + held.get(m.name, logits + hidden)) for m in out]
