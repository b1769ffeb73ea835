"""The moments `parallel.overlap` adds to a block's backward: its MLP entry's, where gate's and up's
weight gradients, deferred to it (tpbench.parallel.overlap), are made while the entry's collective
runs; at the top block (`mlp_entry_backward`) and in a block made again by full recompute
(`recomputed_mlp_entry_backward`). docs/theory.md, "Overlap under recompute"."""

from __future__ import annotations

from dataclasses import replace

from tpbench.predict.theory.activations import after_head, layer_activations, recomputed
from tpbench.predict.theory.blocks import prefetched_input, stream_mask, top_block_grads
from tpbench.predict.theory.dims import LOSS_AND_GRAD, Dims
from tpbench.predict.theory.moments import Moment
from tpbench.predict.theory.recomputed import recomputed_block


def mlp_entry_temporaries(d: Dims) -> int:
    """The temporaries of an MLP entry backward under parallel.overlap (`mlp_entry_backward`): the
    weight gradients and the output gradients they are made from, the entry's input gradient and its
    collective's other buffer, the stream's gradient, a tied head's gradient."""
    ffn, weight = d.p * d.N * d.I_l, d.I_l * d.H
    incoming = d.p * d.N * d.H + (d.p * d.Ns * d.H if d.sp else d.p * d.N * d.H)
    made = d.p * weight + (d.w * weight if d.mixed else 0)
    temps = max(2 * ffn, ffn + d.w * weight) + made + incoming + d.s * d.Ns * d.H
    return temps + (d.V_l * d.H * d.w if d.tied else 0)


def mlp_entry_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """parallel.overlap: the top block's MLP entry backward, its collective in flight (SP's
    reduce-scatter of the input gradient [N, H] into [Ns, H]; else the all-reduce of its clone) while
    gate's and up's weight gradients, deferred to it (tpbench.parallel.overlap), are made one after
    the other. Each waits with its output gradient [N, I/T] and input (the saved MLP input; under SP
    the re-gathered one, its saved shard freed); at the first both output gradients are alive, at the
    second the first's weight gradient (in the parameters' dtype: `.grad`, set by the entry rather than
    by autograd's accumulation, is a temporary to MemTracker, or still the loop's under the flat DP
    buckets) beside its own being made (and cast to fp32 under mixed precision). The SwiGLU's saved
    tensors, down's, up's and gate's weight casts are freed; down's gradient made."""
    weight = d.I_l * d.H
    temps = mlp_entry_temporaries(d) + prefetched_input(d, 2)
    freed = layer_activations(d)["swiglu"] + stream_mask(d) + (3 * d.p * weight if d.mixed else 0)
    if d.sp and d.block_regather:
        freed += d.p * d.saved_input_tokens * d.H
    grads = top_block_grads(d, ("mlp.down_proj",), buckets, own_grads)
    return Moment("mlp entry backward", P, grads, optim, after_head(acts) - freed + LOSS_AND_GRAD, temps)


def recomputed_mlp_entry_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full recompute with parallel.overlap: block `layer`'s MLP entry backward, gate's and up's
    weight gradients made there (`mlp_entry_backward`) beside what the recomputation still holds: all
    of `recomputed_block` but the SwiGLU's saved tensors (gate's and up's weight casts too, under mixed
    precision), and the residual sum the post-attention norm keeps, a temporary to MemTracker."""
    block = recomputed_block(d, acts, P, optim, buckets, own_grads, layer)
    ffn, residual = d.p * d.N * d.I_l, d.s * d.Ns * d.H
    freed = residual + recomputed(d)["swiglu"] - ffn + (2 * d.p * d.I_l * d.H if d.mixed else 0)
    temps = mlp_entry_temporaries(d) + residual
    return replace(
        block,
        name=f"recomputed mlp entry backward {layer}",
        activations=block.activations - freed,
        temporaries=temps,
    )
