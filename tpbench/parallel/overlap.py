"""Megatron's async TP (`parallel.overlap=true`): backward collectives that run while compute goes on.

Three overlaps, each bit-identical to the blocking order (no sum is made in another order):

- a region's entry backward, f's all-reduce (TP) or g's reduce-scatter (SP): launched as soon as the
  input gradient is summed (q+k+v, gate+up); the region's column-parallel weight gradients, deferred,
  are computed meanwhile; waited before the gradient is returned.
- SP's re-gather of a region's input: launched right after the region's exit backward (g-bar's
  all-gather of the output gradient), behind the row-parallel layer's and the core's backward;
  waited at its first use (the column layers' saved input).
- the DP gradient average of tp x dp runs (`DPGradBuckets`): per bucket, once backward has
  accumulated all its gradients, behind the rest of backward; waited in finish_grads.

Weight gradients of column-parallel layers are deferred (`DeferredWeightGrads`): their backward
returns the input gradient only, the weight gradient is computed by the region's entry op after it
has launched its collective, with the same matmul autograd would run (grad^T @ x), and accumulated
into `.grad` as autograd would (the first assigned, a later one added).

SP's forward all-gather is not overlapped: its input, the normed shard, is made by the op just
before it and its output is needed by the very next op (q/k/v or gate/up), so there is no compute
to hide it behind short of cutting each GEMM in chunks and pipelining them with the ring (Megatron's
userbuffers); likewise the exits (f-bar, g-bar) and g-bar's backward all-gather. On gloo that does not
pay: a chunk's collective takes its CPU from the next chunk's GEMM on the same cores, so the exits come
out slower pipelined and SP's entry hides 0.3% of a step (scripts/overlap_bound.py, docs/results/speed.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tpbench.parallel import collectives
from tpbench.parallel.layers import ColumnParallelLinear
from tpbench.parallel.wrappers import behaviour, wrap


class DeferredWeightGrads:
    """The weight gradients of one region's column-parallel layers, waiting for the region's entry
    backward to compute them while its collective runs (a regions.Meanwhile). `on_ready(param)` is
    called after each. `wait=False` only to prove validation catches an entry gradient read before
    its collective lands (debug.overlap_fault=no_wait)."""

    def __init__(self, wait: bool = True) -> None:
        self.pending: list[tuple[nn.Parameter, Callable[[], torch.Tensor]]] = []
        self.on_ready: Callable[[nn.Parameter], None] = lambda param: None
        self.wait = wait

    def add(self, param: nn.Parameter, make: Callable[[], torch.Tensor]) -> None:
        self.pending.append((param, make))

    def run(self) -> None:
        while self.pending:
            param, make = self.pending.pop(0)
            grad = make()
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad
            self.on_ready(param)


class _LinearDeferredWeightGrad(torch.autograd.Function):
    """y = x W^T (+ b); backward returns dx now and leaves dW of `param` to `deferred`. The weight
    comes in detached (cast to x's dtype under autocast): its gradient reaches `param` only through
    `deferred`, so autograd's own accumulation (and its hooks) never sees it."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferred, param):
        ctx.save_for_backward(x, weight)
        ctx.deferred, ctx.param, ctx.has_bias = deferred, param[0], bias is not None
        return F.linear(x, weight, bias)  # [..., in] -> [..., out/T]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2d = grad.reshape(-1, grad.shape[-1])  # [S*B, out/T]
        dx = g2d.mm(weight).view(*grad.shape[:-1], weight.shape[1])  # as MmBackward: grad @ W
        x2d = x.reshape(-1, x.shape[-1])  # [S*B, in]
        dtype = ctx.param.dtype
        ctx.deferred.add(ctx.param, lambda: g2d.t().mm(x2d).to(dtype))  # [out/T, in], as MmBackward
        db = grad.sum(tuple(range(grad.dim() - 1))) if ctx.has_bias else None
        return dx, None, db, None, None


def linear_deferred(
    x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None, deferred: DeferredWeightGrads
) -> torch.Tensor:
    """F.linear whose weight gradient `deferred` computes later (in the region's entry backward).
    Under autocast the weight and bias are cast to x's dtype, as autocast would cast them (the plan
    casts a region's input once, before its entry op)."""
    with torch.autocast(x.device.type, enabled=False):
        w = weight.detach().to(x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        return _LinearDeferredWeightGrad.apply(x, w, b, deferred, (weight,))


class DeferringWeightGrad:
    """A column-parallel layer's behaviour (tpbench.parallel.wrappers.wrap): its weight gradient goes
    to its `deferred` queue instead of autograd's accumulation."""

    deferred: DeferredWeightGrads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_deferred(x, self.weight, self.bias, self.deferred)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", weight gradient deferred to the entry's backward"


behaviour(DeferringWeightGrad)  # innermost: the layer's own forward, behind its entry (per linear)


def defer_weight_grads(region: nn.Module, wait: bool = True) -> DeferredWeightGrads:
    """Make every column-parallel layer of `region` (the region itself, for the LM head) leave its
    weight gradient to the returned queue, which the region's entry op runs in backward."""
    deferred = DeferredWeightGrads(wait)
    for layer in region.modules():
        if isinstance(layer, ColumnParallelLinear):
            wrap(layer, DeferringWeightGrad).deferred = deferred
    return deferred


class DPGradBuckets:
    """The DP gradient average of tp x dp runs in buckets, each all-reduced as soon as backward has
    accumulated all its gradients, as DDP does; `finish()` launches the rest and waits for all.

    Buckets fill in reverse parameter order (about the order backward makes gradients) up to
    `bucket_bytes`. `late` parameters are summed last, in one bucket, after the TP gradient sums that
    must see them first (q/k norms, SP norms, KV replicas), as the blocking order does, and so is a
    weight that gets gradients from two places (the LM head tied to the embedding under VP).
    Each element is summed over the same ranks as in one coalesced all-reduce: bit-identical for
    dp=2 (a + b); for dp > 2 gloo's ring may add in another order where chunk boundaries move."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        late: set[str],
        group: collectives.Group,
        bucket_bytes: float,
        early_launch: bool = False,
    ):
        self.params, self.group, self.dp = params, group, collectives.group_size(group)
        self.early_launch = early_launch  # only to prove validation catches a bucket sent too soon
        self.buckets: list[list[str]] = []
        size = bucket_bytes + 1  # the first parameter opens a bucket
        for name in reversed([n for n in params if n not in late]):
            p = params[name]
            if size + p.numel() * p.element_size() > bucket_bytes and size > 0:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(name)
            size += p.numel() * p.element_size()
        self.buckets.append([n for n in params if n in late])
        self.bucket_of = {n: i for i, names in enumerate(self.buckets[:-1]) for n in names}
        self._reset()

    def _reset(self) -> None:
        self.missing = [len(names) for names in self.buckets]
        self.pending: list[tuple[list[str], collectives.Pending] | None] = [None] * len(self.buckets)

    def ready(self, name: str) -> None:
        """Parameter `name` has its gradient of this backward."""
        i = self.bucket_of.get(name)
        if i is None:
            return
        self.missing[i] -= 1
        if self.missing[i] == 0 or self.early_launch:
            self._launch(i)

    def _launch(self, i: int) -> None:
        if self.pending[i] is not None:
            return
        names = [n for n in self.buckets[i] if self.params[n].grad is not None]
        if names:
            flat = torch.cat([self.params[n].grad.reshape(-1) for n in names])
            self.pending[i] = names, collectives.all_reduce_async(flat, self.group, "dp_grad")

    def finish(self) -> None:
        """Launch what is not launched yet (the late bucket), wait for all, average into `.grad`."""
        for i in range(len(self.buckets)):
            self._launch(i)
        for names, pending in filter(None, self.pending):
            flat = pending.wait() / self.dp
            offset = 0
            for name in names:
                grad = self.params[name].grad
                grad.copy_(flat.narrow(0, offset, grad.numel()).view_as(grad))
                offset += grad.numel()
        self._reset()
