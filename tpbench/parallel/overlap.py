"""Megatron's async TP (`parallel.overlap=true`): backward collectives that run while compute goes on.

Three overlaps, each bit-identical to the blocking order (no sum is made in another order):

- a region's entry backward, f's all-reduce (TP) or g's reduce-scatter (SP): launched as soon as the
  input gradient is summed (q+k+v, gate+up); the region's column-parallel weight gradients, deferred,
  are computed meanwhile; waited before the gradient is returned.
- SP's re-gather of a region's input: launched right after the region's exit backward (g-bar's
  all-gather of the output gradient), behind the row-parallel layer's and the core's backward;
  waited at its first use (the column layers' saved input).
- the DP gradient average of tp x dp runs (`DPGradBuckets`): per bucket, once backward has
  accumulated all its gradients, behind the rest of backward; waited in finish_grads. Each bucket is
  one persistent flat buffer and its parameters' `.grad` are views into it (DDP's
  gradient_as_bucket_view): the all-reduce runs on the buffer in place, with no copy of the
  gradients (a `torch.cat` of them was one more gradient's worth of memory).

Weight gradients of column-parallel layers are deferred (`DeferredWeightGrads`): their backward
returns the input gradient only, the weight gradient is computed by the region's entry op after it
has launched its collective, with the same matmul autograd would run (grad^T @ x), and accumulated
into `.grad` as autograd would (the first assigned, a later one added).

SP's forward all-gather is not overlapped: its input, the normed shard, is made by the op just
before it and its output is needed by the very next op (q/k/v or gate/up), so there is no compute
to hide it behind short of cutting each GEMM in chunks and pipelining them with the ring (Megatron's
userbuffers); likewise the exits (f-bar, g-bar) and g-bar's backward all-gather. On gloo that does not
pay: a chunk's collective takes its CPU from the next chunk's GEMM on the same cores, so the exits come
out slower pipelined and SP's entry hides 0.3% of a step (benchmarks/overlap_bound.py, docs/results/speed.md).
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
    called after each: DPGradBuckets' `ready`, or ZeRO-1's `add_to_buffer`, which sums it into the
    fp32 grad buffer at once (under mixed precision `.grad` is bf16: never a sum across
    micro-batches). `wait=False` only to prove validation catches an entry gradient read before its
    collective lands (debug.overlap_fault=no_wait)."""

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
    dp=2 (a + b); for dp > 2 gloo's ring may add in another order where chunk boundaries move.

    Each bucket has a flat buffer for good, made with the buckets (a bucket holds one dtype: a
    parameter of another opens a new one). As a parameter's gradient of this backward is ready, it
    is copied into its slot and `.grad` becomes the slot's view (autograd made the gradient: the
    optimizer's zero_grad(set_to_none=True) dropped the view, as DDP's buckets see it), freeing what
    autograd made; a later accumulation adds into the view in place. The all-reduce and the average
    run on the buffer in place."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        late: set[str],
        group: collectives.Group,
        bucket_bytes: float,
        early_launch: bool = False,
        reduce_dtype: torch.dtype | None = None,
    ):
        self.params, self.group, self.dp = params, group, collectives.group_size(group)
        self.early_launch = early_launch  # only to prove validation catches a bucket sent too soon
        self.reduce_dtype = reduce_dtype  # debug.low_precision_reduce: each bucket sent in this dtype
        self.buckets: list[list[str]] = []
        size = bucket_bytes + 1  # the first parameter opens a bucket
        for name in reversed([n for n in params if n not in late]):
            p = params[name]
            other_dtype = self.buckets and params[self.buckets[-1][-1]].dtype != p.dtype
            if (size + p.numel() * p.element_size() > bucket_bytes and size > 0) or other_dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(name)
            size += p.numel() * p.element_size()
        late_names = [n for n in params if n in late]
        for dtype in dict.fromkeys(params[n].dtype for n in late_names) or [None]:  # the late ones
            self.buckets.append([n for n in late_names if params[n].dtype == dtype])
        self.bucket_of = {n: i for i, names in enumerate(self.buckets) for n in names}
        self.late = {i for i, names in enumerate(self.buckets) if names and names[0] in late}
        self.flat: list[torch.Tensor] = []
        self.views: dict[str, torch.Tensor] = {}
        for names in self.buckets:
            first = params[names[0]] if names else None
            flat = torch.zeros(
                sum(params[n].numel() for n in names),
                dtype=first.dtype if first is not None else torch.float32,
                device=first.device if first is not None else None,
            )
            offset = 0
            for n in names:
                self.views[n] = flat.narrow(0, offset, params[n].numel()).view_as(params[n])
                offset += params[n].numel()
            self.flat.append(flat)
        self._reset()

    def _reset(self) -> None:
        self.missing = [len(names) for names in self.buckets]
        self.pending: list[collectives.Pending | None] = [None] * len(self.buckets)

    def ready(self, name: str) -> None:
        """Parameter `name` has its gradient of this backward."""
        i = self.bucket_of.get(name)
        if i is None or i in self.late:
            return
        self._into_slot(name)
        self.missing[i] -= 1
        if self.missing[i] == 0 or self.early_launch:
            self._launch(i)

    def _into_slot(self, name: str) -> None:
        """`.grad` of `name` as the view of its slot, its value kept; without a gradient, the slot
        zeroed and `.grad` left None (the optimizer skips it, as before)."""
        param, view = self.params[name], self.views[name]
        if param.grad is None:
            view.zero_()
        elif param.grad is not view:  # not by data_ptr: a fake (meta) tensor's is its storage offset,
            view.copy_(param.grad)  # so the gradient of a bucket's first slot (offset 0) matched it
            param.grad = view

    def _launch(self, i: int) -> None:
        if self.pending[i] is not None or not self.buckets[i]:
            return
        for name in self.buckets[i]:  # the late ones, and any whose gradient never came
            self._into_slot(name)
        sent = self.flat[i] if self.reduce_dtype is None else self.flat[i].to(self.reduce_dtype)
        self.pending[i] = collectives.all_reduce_async(sent, self.group, "dp_grads")

    def finish(self) -> None:
        """Launch what is not launched yet (the late buckets), wait for all, average in place (the
        parameters' `.grad` are the buffers' views)."""
        for i in range(len(self.buckets)):
            self._launch(i)
        for flat, pending in zip(self.flat, self.pending, strict=True):
            if pending is not None:
                summed = pending.wait()
                if summed is not flat:  # sent in debug.low_precision_reduce's dtype: back into fp32
                    flat.copy_(summed)
                flat.div_(self.dp)
        self._reset()
