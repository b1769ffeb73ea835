"""Cross entropy on vocab-sharded logits, without ever building the full [S, B, V] logits.

Forward: three all-reduces of [S, B] fp32 over the TP group: MAX of the row max, SUM of the target
logit (owned by one rank, zero elsewhere), SUM of sum(exp(logit - max)). loss = log(sumexp) - target.
Backward needs no communication: softmax minus one-hot on the owning rank, times grad_output.
Padded vocab columns (index >= the real V) are kept out of the softmax.

Memory, as Megatron's vocab_parallel_cross_entropy: one fp32 [S, B, V/T] buffer, a copy of the
logits (never the caller's tensor, which validation reads after the loss), that becomes logits - max,
then their exp, then the softmax in place; the softmax is what backward keeps, and backward turns it
into the gradient in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tpbench.models.minimind import IGNORE_INDEX
from tpbench.parallel import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        # logits [S, B, V/T] (this rank's vocab columns), targets [S, B] global ids or IGNORE_INDEX
        ctx.dtype = logits.dtype
        x = logits.to(torch.float32, copy=True)  # [S, B, V/T], the only buffer of that size
        v_local = x.shape[-1]
        if vocab_start + v_local > vocab_size:  # padded columns: known from the sizes, no host sync
            x[..., max(vocab_size - vocab_start, 0) :] = float("-inf")

        row_max = x.max(dim=-1).values  # [S, B]
        comm.all_reduce(row_max, group, "loss", op=dist.ReduceOp.MAX)
        x -= row_max.unsqueeze(-1)  # logits - max

        valid = targets != IGNORE_INDEX
        local = targets - vocab_start
        owned = valid & (local >= 0) & (local < v_local)
        local = local.masked_fill(~owned, 0)
        target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1) * owned  # [S, B]
        comm.all_reduce(target_logit, group, "loss")

        x.exp_()  # exp(logits - max)
        sum_exp = x.sum(dim=-1)  # [S, B]
        comm.all_reduce(sum_exp, group, "loss")

        n_valid = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target_logit) * valid).sum() / n_valid

        x /= sum_exp.unsqueeze(-1)  # softmax over the full vocab, this rank's columns
        ctx.save_for_backward(x, local, owned, valid, n_valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad, local, owned, valid, n_valid = ctx.saved_tensors  # grad: the saved softmax, used once
        grad.scatter_add_(-1, local.unsqueeze(-1), -owned.unsqueeze(-1).to(grad.dtype))
        grad *= (valid.to(grad.dtype) * grad_loss / n_valid).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for CausalLMLoss when the LM head is column parallel over the vocab."""

    def __init__(self, vocab_size: int, tp_rank: int, group: comm.Group):
        super().__init__()
        self.vocab_size = vocab_size  # the real V; columns past it are padding
        self.tp_rank = tp_rank
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab_start = self.tp_rank * logits.shape[-1]
        return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, self.vocab_size, self.group)
