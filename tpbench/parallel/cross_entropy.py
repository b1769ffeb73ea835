"""Cross entropy on vocab-sharded logits, without ever building the full [S, B, V] logits.

Forward: three all-reduces of [S, B] fp32 over the TP group: MAX of the row max, SUM of the target
logit (owned by one rank, zero elsewhere), SUM of sum(exp(logit - max)). loss = log(sumexp) - target.
Backward needs no communication: softmax minus one-hot on the owning rank, times grad_output.
Padded vocab columns (index >= the real V) are kept out of the softmax.

Memory: no fp32 tensor of the logits' size. The fp32 work runs on LOSS_CHUNKS slices of the tokens
in turn (as Liger's and Megatron's fused cross entropies chunk it), each an fp32 [N/LOSS_CHUNKS, V/T]
buffer that becomes logits - max, then their exp; backward keeps the logits themselves (the head's
output, in the activation dtype) with each row's max and sum of exp, and makes the softmax again slice
by slice. The gradient takes the logits' place, as Megatron's works in place: each slice is read before
its gradient is written over it, so the logits a model returns hold their gradient once backward has
run (read them before; a leaf, a caller's own tensor, is left alone and gets a new gradient). The ops
on each element are those of the unchunked loss: the same loss and gradient, bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from tpbench.models.minimind import IGNORE_INDEX
from tpbench.parallel import collectives

LOSS_CHUNKS = 8  # slices of the tokens the fp32 work runs on, one at a time


def _shifted(logits: torch.Tensor, row_max: torch.Tensor, real: int) -> torch.Tensor:
    """fp32 logits - max of a slice of tokens, padded columns (index >= real) at -inf: [n, V/T]."""
    x = logits.to(torch.float32, copy=True)  # a copy even of fp32 logits: never the caller's tensor
    if real < x.shape[-1]:
        x[:, max(real, 0) :] = float("-inf")
    x -= row_max.unsqueeze(-1)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        # logits [S, B, V/T] (this rank's vocab columns), targets [S, B] global ids or IGNORE_INDEX
        flat, flat_targets = logits.view(-1, logits.shape[-1]), targets.reshape(-1)  # [N, V/T], [N]
        v_local = flat.shape[-1]
        real = vocab_size - vocab_start  # columns of this rank before the padding (may be <= 0)
        rows = math.ceil(flat.shape[0] / LOSS_CHUNKS)

        row_max = flat[:, : max(real, 0)].max(dim=-1).values.float() if real > 0 else None  # [N]
        if row_max is None:  # a rank holding padding only
            row_max = flat.new_full((flat.shape[0],), float("-inf"), dtype=torch.float32)
        collectives.all_reduce(row_max, group, "loss", op=dist.ReduceOp.MAX)

        valid = flat_targets != IGNORE_INDEX
        local = flat_targets - vocab_start
        owned = valid & (local >= 0) & (local < v_local)
        local = local.masked_fill(~owned, 0)
        target_logit = (flat.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() - row_max) * owned  # [N]
        collectives.all_reduce(target_logit, group, "loss")

        sum_exp = torch.empty_like(row_max)  # [N]
        for i in range(0, flat.shape[0], rows):
            part = slice(i, i + rows)
            sum_exp[part] = _shifted(flat[part], row_max[part], real).exp_().sum(dim=-1)
        collectives.all_reduce(sum_exp, group, "loss")

        n_valid = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target_logit) * valid).sum() / n_valid
        ctx.real, ctx.rows, ctx.in_place = real, rows, not logits.is_leaf
        ctx.save_for_backward(logits, row_max, sum_exp, local, owned, valid, n_valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, row_max, sum_exp, local, owned, valid, n_valid = ctx.saved_tensors
        flat = logits.view(-1, logits.shape[-1])  # [N, V/T]
        grad = flat if ctx.in_place else torch.empty_like(flat)  # each slice read, then written over
        scale = valid.to(torch.float32) * grad_loss / n_valid  # [N]
        for i in range(0, flat.shape[0], ctx.rows):
            part = slice(i, i + ctx.rows)
            grad[part] = _grad_slice(flat[part], row_max[part], sum_exp[part], local[part], owned[part],
                                     scale[part], ctx.real)  # fmt: skip
        return grad.view_as(logits), None, None, None, None


def _grad_slice(logits, row_max, sum_exp, local, owned, scale, real: int) -> torch.Tensor:
    """The loss's gradient on a slice of n tokens, fp32 [n, V/T]: (softmax - one-hot) * scale. Its
    own function, so that a slice's buffer is freed before the next one is made."""
    x = _shifted(logits, row_max, real).exp_()
    x /= sum_exp.unsqueeze(-1)  # the softmax over the full vocab, this rank's columns
    x.scatter_add_(-1, local.unsqueeze(-1), -owned.unsqueeze(-1).to(x.dtype))
    x *= scale.unsqueeze(-1)
    return x


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for CausalLMLoss when the LM head is column parallel over the vocab."""

    def __init__(self, vocab_size: int, tp_rank: int, group: collectives.Group):
        super().__init__()
        self.vocab_size = vocab_size  # the real V; columns past it are padding
        self.tp_rank = tp_rank
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab_start = self.tp_rank * logits.shape[-1]
        return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, self.vocab_size, self.group)
