"""ZeRO-1, Megatron's distributed optimizer (`parallel.dp_shard=optimizer`): each DP rank keeps an
even 1/DP flat shard of the master weights and of both AdamW moments.

Per DP group (the ranks that hold the same TP shard), with N the TP-local parameter count, padded
up to P = ceil(N / DP) * DP so that every rank's shard is P / DP elements:

    grad buffer   [P]       the gradients, flat (reduce dtype: fp32 under mixed precision), the
                            parameters' `.grad` are views of it where the dtypes agree
    reduce-scatter          grad buffer [P] -> this rank's [P/DP], averaged over DP (one per step)
    master shard  [P/DP]    fp32 under mixed, its own copy; in pure precision the param buffer's own
                            [P/DP] view (one copy of the weights, stepped in place); AdamW's m and v
    all-gather              the stepped shard (in the parameters' dtype) [P/DP] -> param buffer [P]
    param buffer  [P]       the model's parameters are views of it (bf16 under mixed precision);
                            in pure precision the all-gather's input is its own shard (in place)

AdamW is elementwise, so one AdamW over the flat shard takes the same steps as one per parameter
(the same learning rate for all, and its schedule: tpbench.experiments.optim). The padding stays zero:
its gradients are zero and so is its weight decay's pull.

Weight-decay groups (train.no_decay): the buffers hold the decayed parameters first, then the others,
then the padding, so each rank's shard is a decayed part, then an undecayed one (either may be empty:
one rank's shard at most straddles the boundary D). AdamW steps the shard at weight decay 0, and the
decayed part is decayed before it as AdamW decays a parameter (`p.mul_(1 - lr * weight_decay)`, the
decoupled decay of torch's per-tensor and foreach AdamW): the same update, element by element, as
the dense model's AdamW with the two groups, and not a byte more than one group (no second AdamW
state, no step counter more, no padding).

Main gradients: fp32 under mixed precision for every parameter (each bf16 gradient added into its
fp32 slot, then freed); in pure precision the buffer is in the parameters' dtype, bf16 in pure bf16,
as the dense model's own gradients are (validation compares like with like).

The TP gradient sums (q/k norms, SP norms, KV replicas) run on the buffer's views before the
reduce-scatter, as they ran on `.grad` before DDP's average: a sum over TP ranks and an average over
DP ranks commute, each element summed over the same ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tpbench.parallel import collectives


class DistributedOptimizer:
    """The flat buffers, the master shard and its AdamW for the parameters `params` (this rank's TP
    shards, in the model's order) over the DP `group`.

    make_adamw builds the AdamW of the master shard; param_dtype: the model's weights' (bf16 under
    mixed precision); master_dtype: the master weights' and the gradient reduction's (fp32 under
    mixed precision); fault: debug.shard_fault; reduce_dtype: the reduce-scatter's (None: the grad
    buffer's, master_dtype; the compute dtype only to prove validation catches it:
    debug.low_precision_reduce); decays: which parameters make_adamw's weight decay applies to (None:
    all, AdamW decays the whole shard itself, as before the groups)."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        group: collectives.Group,
        make_adamw: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        param_dtype: torch.dtype,
        master_dtype: torch.dtype,
        fault: str = "",
        reduce_dtype: torch.dtype | None = None,
        decays: Callable[[str], bool] | None = None,
    ):
        self.params, self.group, self.fault = params, group, fault
        self.reduce_dtype = reduce_dtype or master_dtype
        self.dp = collectives.group_size(group)
        self.dp_rank = 0 if group is None else dist.get_rank(group)
        first = next(iter(params.values()))
        numel = sum(p.numel() for p in params.values())
        self.shard_numel = -(-numel // self.dp)  # [P/DP]
        padded = self.shard_numel * self.dp
        self.param_buffer = torch.zeros(padded, dtype=param_dtype, device=first.device)  # [P]
        self.grad_buffer = torch.zeros(padded, dtype=master_dtype, device=first.device)  # [P]
        self.param_views: dict[str, torch.Tensor] = {}
        self.grad_views: dict[str, torch.Tensor] = {}
        offsets, decayed = _offsets(params, decays)  # the decayed parameters first: [0, D)
        for name, p in params.items():  # the views in the model's order, wherever they sit
            self.param_views[name] = self.param_buffer.narrow(0, offsets[name], p.numel()).view_as(p)
            self.grad_views[name] = self.grad_buffer.narrow(0, offsets[name], p.numel()).view_as(p)
        with torch.no_grad():
            if master_dtype == param_dtype:  # pure precision: AdamW steps the param buffer's own shard
                for name, p in params.items():
                    self.param_views[name].copy_(p)
                self.master = nn.Parameter(self._mine(self.param_buffer))  # [P/DP], a view: one copy
            else:  # the fp32 master shard from the weights as they come, then the bf16 param buffer
                for name, p in params.items():
                    self.grad_views[name].copy_(p)  # the grad buffer lends its [P] for a moment
                self.master = nn.Parameter(self._mine(self.grad_buffer).clone())  # [P/DP]
                self.grad_buffer.zero_()
                for name, p in params.items():
                    self.param_views[name].copy_(p)
        self.adamw = make_adamw([self.master])
        # decays given: this rank's part of [0, D), decayed here, and AdamW at weight decay 0
        self.weight_decay, self.decayed = 0.0, self.shard_numel
        if decays is not None:
            group = self.adamw.param_groups[0]
            self.weight_decay, group["weight_decay"] = group["weight_decay"], 0.0
            self.decayed = min(max(decayed - self.dp_rank * self.shard_numel, 0), self.shard_numel)
        for name, p in params.items():
            p.data = self.param_views[name]  # the model's weights live in the param buffer
            p.register_post_accumulate_grad_hook(lambda p, name=name: self.add_to_buffer(name))

    def _mine(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a padded flat [P] tensor: [P/DP]."""
        return flat.narrow(0, self.dp_rank * self.shard_numel, self.shard_numel)

    def add_to_buffer(self, name: str) -> None:
        """Parameter `name`'s gradient of this backward, added into its slot of the grad buffer (zero
        at the step's start). Where the dtypes agree `.grad` becomes the slot's view and later
        accumulations add into it in place; else (bf16 gradients, fp32 buffer) `.grad` is freed."""
        p, view = self.params[name], self.grad_views[name]
        if p.grad is None or p.grad is view:  # not by data_ptr: a fake tensor's is its storage offset
            return
        view.add_(p.grad)
        p.grad = view if p.grad.dtype == view.dtype else None

    def gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient slot, after sweeping in any gradient still in `.grad` (none
        once ZeroModel hands parallel.overlap's deferred ones in as they are made)."""
        for name in self.params:
            self.add_to_buffer(name)
        return self.grad_views

    def reduce_scatter(self) -> None:
        """The DP average of the gradients into this rank's shard: grad buffer [P] -> [P/DP]."""
        if self.fault == "no_reduce_scatter":  # this rank's own gradients, never averaged
            self.grad_shard = self._mine(self.grad_buffer).clone()
        else:
            sent = self.grad_buffer.to(self.reduce_dtype)  # the buffer itself where the dtypes agree
            shard = collectives.reduce_scatter(sent, self.group, "dp_grads")
            self.grad_shard = shard.to(self.grad_buffer.dtype).div_(self.dp)

    @property
    def state(self) -> dict:
        """The AdamW state of the master shard (its moments and step)."""
        return self.adamw.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            p.grad = None
        self.grad_buffer.zero_()
        self.adamw.zero_grad(set_to_none=True)

    def step(self) -> None:
        """AdamW on the master shard, then the stepped weights all-gathered into every rank's params."""
        self.master.grad = self.grad_shard.to(self.master.dtype)
        if self.weight_decay and self.decayed:  # the decayed part (groups), as AdamW would decay it
            with torch.no_grad():
                lr = self.adamw.param_groups[0]["lr"]
                self.master.narrow(0, 0, self.decayed).mul_(1 - lr * self.weight_decay)
        self.adamw.step()
        self.master.grad, self.grad_shard = None, None
        shard = self.master.detach().to(self.param_buffer.dtype)  # [P/DP]
        if self.fault == "no_all_gather":  # the other ranks' shards stay as they were
            self._mine(self.param_buffer).copy_(shard)
            return
        collectives.all_gather_into(self.param_buffer, shard, self.group, "dp_params")

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's averaged gradient, the shards all-gathered (for checks only: not counted
        as a step's)."""
        return self._unflatten(collectives.all_gather(self.grad_shard, self.group, "check"))

    def write_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        """Whole gradients (as full_gradients gives them): the part of each in this rank's shard
        written into the shard the step takes (validate's sign rule only; no collective)."""
        base, first = self.grad_buffer.storage_offset(), self.dp_rank * self.shard_numel
        with torch.no_grad():
            for name, grad in grads.items():
                start = self.grad_views[name].storage_offset() - base
                lo, hi = max(start, first), min(start + grad.numel(), first + self.shard_numel)
                if lo < hi:
                    part = grad.reshape(-1).narrow(0, lo - start, hi - lo)
                    self.grad_shard.narrow(0, lo - first, hi - lo).copy_(part)

    def full_masters(self) -> dict[str, torch.Tensor]:
        """Every parameter's master weights (fp32 under mixed precision), gathered as full_gradients."""
        return self._unflatten(collectives.all_gather(self.master.detach(), self.group, "check"))

    def shard_of(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Whole per-parameter tensors (shaped as the parameters: weights, AdamW moments) flattened
        as the buffers are, this rank's [P/DP] of them in the master dtype, the padding zeros (a copy;
        tpbench.experiments.optimizer_check)."""
        flat = torch.zeros_like(self.grad_buffer, dtype=self.master.dtype)  # [P]
        base = self.grad_buffer.storage_offset()
        for name, view in self.grad_views.items():
            flat.narrow(0, view.storage_offset() - base, view.numel()).copy_(tensors[name].reshape(-1))
        return self._mine(flat).clone()

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A gathered [P] -> each parameter's view, shaped as the parameter."""
        base = self.grad_buffer.storage_offset()
        return {
            name: flat.narrow(0, view.storage_offset() - base, view.numel()).view_as(view)
            for name, view in self.grad_views.items()
        }


def _offsets(
    params: dict[str, nn.Parameter], decays: Callable[[str], bool] | None
) -> tuple[dict[str, int], int]:
    """Each parameter's offset in the flat [P] buffers: the decayed ones first, then the others, each
    in the model's order (None: all in the model's order); and D, the decayed parameters' count."""
    first = [n for n in params if decays is None or decays(n)]
    offsets, offset, decayed = {}, 0, set(first)
    for name in first + [n for n in params if n not in decayed]:
        offsets[name] = offset
        offset += params[name].numel()
    return offsets, sum(params[n].numel() for n in first)


class ZeroModel:
    """A parallel model (tpbench.parallel.plan.ParallelModel: any TP mode, or the dense model at tp
    1) whose DP average is ZeRO-1's reduce-scatter instead of an all-reduce: the model's interface
    for training and the checks, with `optimizer` its DistributedOptimizer."""

    def __init__(
        self,
        pm,
        make_adamw: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        param_dtype: torch.dtype,
        master_dtype: torch.dtype,
        fault: str = "",
        reduce_dtype: torch.dtype | None = None,
        decays: Callable[[str], bool] | None = None,
    ):
        self.pm, self.module, self.ctx = pm, pm.module, pm.ctx
        pm.grad_sums = [gs for gs in pm.grad_sums if gs.name != "dp"]  # the reduce-scatter's now
        params = dict(self.module.named_parameters())
        group = pm.ctx.dp_group
        self.optimizer = DistributedOptimizer(
            params, group, make_adamw, param_dtype, master_dtype, fault, reduce_dtype, decays
        )
        # parallel.overlap's deferred weight gradients (q, k, v, gate, up: made outside autograd, so
        # no hook sees them) go into the buffer as each is made, as autograd's do: under mixed
        # precision each micro-batch's bf16 gradient is summed in the fp32 buffer, never in bf16
        names = {id(p): name for name, p in params.items()}
        for deferred in pm.deferred:
            deferred.on_ready = lambda p: self.optimizer.add_to_buffer(names[id(p)])

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.pm(input_ids, labels)

    def finish_grads(self) -> None:
        """The TP gradient sums on the grad buffer's views, then the reduce-scatter."""
        grads = self.optimizer.gradients()
        for gs in self.pm.grad_sums:
            collectives.all_reduce_coalesced([grads[n] for n in gs.params], gs.group, "grad_sum")
        self.optimizer.reduce_scatter()

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self.optimizer.full_gradients()

    def write_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        self.optimizer.write_gradients(grads)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The master weights the optimizer steps (under mixed precision, not the bf16 copies)."""
        return self.optimizer.full_masters()

    def semantics(self, name: str) -> str:
        return self.pm.semantics(name)

    def shard_like(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        return self.pm.shard_like(name, dense)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.pm.full_logits(logits)
