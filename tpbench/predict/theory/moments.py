"""A moment of the step (`Moment`: its live bytes by MemTracker's categories), and what the loss holds
at its moments beyond the saved activations: its peak (backward, or the vocab-parallel loss's forward
at a slice), a dense loss's forward end and the vocab-parallel loss's backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpbench.parallel.cross_entropy import LOSS_CHUNKS
from tpbench.predict.theory.dims import FP32, INT64, LOSS_AND_GRAD, Dims


@dataclass
class Moment:
    """The live bytes at one moment of the step, by MemTracker's categories."""

    name: str
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int
    # of the above, the bytes FSDP2 holds on its own streams: its reduce-scatter stream's gradient
    # shards and outputs, its copy-in stream's flat all-gather outputs; in pools the default stream
    # cannot reuse (tpbench.predict.theory.reserved). 0 without FSDP2
    streams: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries


def loss_extra(d: Dims) -> tuple[int, int]:
    """(activation, temporary) bytes of the loss at its peak, beyond the saved activations.

    Dense loss (F.cross_entropy on logits.float()): the peak is log_softmax's backward, holding its
    fp32 output (saved), the fp32 gradient from nll_loss and the fp32 gradient it makes: 3 x 4 N V
    (the logits themselves are gone by then: nothing saves them), and the loss and its gradient.
    With fused_loss (model.fused_ops on CUDA) the gradient it makes is the logits' own, in p.
    Vocab-parallel loss (tpbench.parallel.cross_entropy): its forward holds the logits, the [N]
    bookkeeping and one fp32 slice of LOSS_CHUNKS of the tokens (`loss_slice`) with its sum of exp
    (fp32, the slice's rows), made before it is written into the [N] one; its backward is
    `loss_backward`.
    The seed's logits.float().mean(): the logits and their fp32 copy (unless they are fp32), with the
    loss and the gradient backward starts from (ones_like), all four alive at backward's first op;
    its backward is the logits' gradient of the head's backward."""
    nv = d.N * d.V_l
    if d.logits_mean:
        return d.p * nv + (FP32 * nv if d.p != FP32 else 0) + LOSS_AND_GRAD, 0
    if not d.vp:  # fused_loss: log_softmax's backward writes the p gradient directly
        return FP32 * nv + LOSS_AND_GRAD, FP32 * nv + (d.p if d.fused_loss else FP32) * nv
    # at a slice: targets and local ids (int64); row max, target logit, sum of exp (fp32); valid and
    # owned masks (bool)
    small = (2 * INT64 + 3 * FP32 + 2) * d.N
    return d.p * nv + small, loss_slice(d) + FP32 * math.ceil(d.N / LOSS_CHUNKS)


def loss_forward(d: Dims) -> int:
    """Bytes of a dense loss at the end of its forward, beyond the saved activations: the logits and
    their fp32 copy (unless they are fp32); cross entropy's log_softmax output, the shifted targets
    (int64 [N]), the loss and nll's total weight; the mean's scalar. Only beside the forward-only
    weight casts (mixed precision with recompute) can it outgrow the loss's backward.
    model.fused_ops: the copy is log_softmax's own (on a CPU; on CUDA there is none), freed as it
    returns: the peak is then log_softmax's, before nll_loss makes its two scalars."""
    nv = d.N * d.V_l
    copy = FP32 * nv if d.p != FP32 and (d.logits_mean or not d.fused_loss) else 0
    if d.logits_mean:
        return d.p * nv + copy + FP32
    scalars = 0 if d.fused_ops and copy else 2 * FP32
    return d.p * nv + copy + FP32 * nv + INT64 * d.N + scalars


def loss_slice(d: Dims) -> int:
    """Bytes of the vocab-parallel loss's fp32 work on one slice of the tokens: [N / LOSS_CHUNKS, V/T]."""
    return FP32 * math.ceil(d.N / LOSS_CHUNKS) * d.V_l


def loss_backward(d: Dims) -> tuple[int, int]:
    """(activation, temporary) bytes of the vocab-parallel loss's backward at a slice's one-hot, beyond
    the saved activations: the logits it keeps (becoming their own gradient, slice by slice), each
    row's max and sum of exp and the gradient's scale (fp32), the local ids and the count of valid
    targets (int64), valid and owned masks, the loss and its gradient; the slice, and the slice's
    owned mask in fp32 and negated (scatter_add_'s source)."""
    rows = math.ceil(d.N / LOSS_CHUNKS)
    act = d.p * d.N * d.V_l + (INT64 + 3 * FP32 + 2) * d.N + INT64 + LOSS_AND_GRAD
    return act, loss_slice(d) + 2 * FP32 * rows


def dtensor_loss_forward(d: Dims) -> int:
    """Bytes of DTensor's vocab-parallel loss at the peak of its forward, beyond the saved activations
    (all activations to MemTracker, in forward): torch's `_log_softmax` under loss_parallel holds the
    logits [N, V/T] in p, their fp32 copy (unless fp32), shifted = x - max and exp(shifted) (or the
    result, once exp is summed), fp32 [N, V/T] each, and five fp32 [N, 1]: the row max and the sum of
    exp, each before and after its all-reduce (a functional collective returns a new tensor), and the
    log of the sum. Less than its backward's (`dtensor_loss_backward`) in the unsharded step; under
    FSDP2 the top block's gathered weights are alive beside it."""
    nv = d.N * d.V_l
    return d.p * nv + (FP32 * nv if d.p != FP32 else 0) + 2 * FP32 * nv + 5 * FP32 * d.N


def dtensor_loss_backward(d: Dims) -> tuple[int, int]:
    """(activation, temporary) bytes of DTensor's vocab-parallel loss (torch's loss_parallel under
    tpbench.parallel.dtensor's _LossParallel) at its peak, beyond the saved activations: the last op of
    torch's fused nll_loss / log_softmax backward (torch/distributed/tensor/parallel/loss.py,
    `_nll_loss_and_log_softmax_backward`: `(grad_input + exp(x)) * grad_output`).

    Held from the forward: the logits [N, V/T] in p (_LossParallel keeps them as its leaf), the fp32
    log_softmax output [N, V/T] that nll saves (the logits' fp32 copy, made under bf16, is gone), the
    targets [N] int64, and three fp32 scalars: the loss, nll's total weight and the gradient backward
    starts from. Made there: the one-hot grad_input (zeros_like), its sum with exp(x) and their product
    with the gradient, three fp32 [N, V/T] (exp(x) itself is freed by then); the target where it is
    valid ([N, 1] int64), _MaskPartial's mask (bool) and masked ids (int64), the -1 update (fp32), the
    row index (arange, int64) and the gradient per row ([N, 1] fp32)."""
    nv = d.N * d.V_l
    act = d.p * nv + FP32 * nv + INT64 * d.N + 3 * FP32
    return act, 3 * FP32 * nv + (2 * FP32 + 3 * INT64 + 1) * d.N
