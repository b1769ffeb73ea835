"""ZeRO-1 as Megatron's distributed optimizer runs it (`parallel.dp_shard=optimizer`): the gradients
reduce-scattered bucket by bucket during backward, the stepped weights all-gathered bucket by bucket
beside the next forward, and each DP rank keeping its 1/DP of every bucket's master weights and both
AdamW moments (megatron/core/distributed/param_and_grad_buffer.py, optimizer/distrib_optimizer.py).

Per DP group (the ranks that hold the same TP shard), with this rank's parameters in the model's
order and DP the group's size:

    buckets       the parameters in reverse order (the order backward makes their gradients), a
                  bucket closed at a parameter boundary once it holds parallel.zero_bucket_elements
                  (0: Megatron's max(40M, 1M x DP)); then the late ones (a TP gradient sum to see
                  first: q/k norms, SP norms, KV replicas; a weight tied to another) in one bucket of
                  their own, in model order. Bucket b holds n_b elements padded to B_b, a multiple of DP
    param buffer  [P], P = sum B_b: the model's parameters are views of it (bf16 under mixed)
    grad buffer   [P]: the main gradients, fp32 under mixed precision for every parameter (each bf16
                  gradient added into its slot, then freed), else the parameters' dtype; `.grad` is
                  the slot's view where the dtypes agree
    shard         this rank's [B_b / DP] of each bucket b (rank r: [r B_b/DP, (r+1) B_b/DP) of it), so
                  S = P / DP elements in all, not one contiguous slice of [P]
    master pieces one per bucket, [B_b / DP]: fp32 copies under mixed precision; in pure precision the
                  param buffer's own piece, stepped in place (one copy of the weights). One AdamW over
                  the pieces: m and v [B_b / DP] each, a step counter per piece

A step:
    backward      each gradient added into its slot as autograd makes it (a post-accumulate-grad
                  hook; parallel.overlap's deferred ones as each is made); once every gradient of a
                  bucket is in, its reduce-scatter is launched, in place: grad bucket [B_b] -> its
                  piece [B_b/DP] of the same buffer (Megatron's). Under train.accumulation only the
                  last micro-batch's backward launches them (set_gradient_sync), the earlier ones sum
                  into the fp32 main gradients
    finish_grads  the TP gradient sums on the late bucket's views, then its reduce-scatter; every
                  reduce-scatter waited, each piece averaged over DP in place
    step          AdamW on the master pieces (their .grad: the grad buffer's pieces); each piece
                  copied into the param buffer's piece (mixed; pure: it is that piece) and its bucket's
                  all-gather launched, in place, [B_b/DP] -> [B_b], in the order the forward needs them
    next forward  a forward pre-hook on each block (and on the embedding, the final norm, the head)
                  waits for the all-gathers of the buckets holding its parameters: Megatron's
                  overlap_param_gather. Under train.compile (a compiled block traces its hooks) all of
                  them are waited at the forward's start; anything else reading the weights calls
                  `wait_params` first

AdamW is elementwise, so one AdamW over the pieces takes the same steps as one per parameter (the
same learning rate for all, and its schedule: tpbench.experiments.optim). The padding stays zero: its
gradients are zero and so is its weight decay's pull.

Weight-decay groups (train.no_decay): each piece's decayed parameters' parts (`decayed`: spans of
the piece, merged where contiguous) are decayed before AdamW steps at weight decay 0, as AdamW decays
a parameter (`p.mul_(1 - lr * weight_decay)`, the decoupled decay of torch's per-tensor and foreach
AdamW): the same update, element by element, as the dense model's AdamW with the two groups, and no
second AdamW state.

In pure precision the buffers are in the parameters' dtype, bf16 in pure bf16, as the dense model's
own gradients are (validation compares like with like).

The TP gradient sums (q/k norms, SP norms, KV replicas) run on the late bucket's views before its
reduce-scatter, as they ran on `.grad` before DDP's average: a sum over TP ranks and an average over
DP ranks commute, each element summed over the same ranks.

Not Megatron's: no padding of each parameter's start to 64 elements nor of a bucket to a multiple of
128 x DP (NCCL bandwidth on GPUs); one bucket group per bucket; the late bucket is Megatron's
`finish_grad_sync` order for parameters that need a TP sum first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tpbench.parallel import collectives
from tpbench.parallel.zero_buckets import bucket_cap, plan_buckets


class DistributedOptimizer:
    """The flat buffers in buckets, the master pieces and their AdamW for the parameters `params`
    (this rank's TP shards, in the model's order) over the DP `group`.

    make_adamw builds the AdamW of the master pieces; param_dtype: the model's weights' (bf16 under
    mixed precision); master_dtype: the master weights' and the gradient reduction's (fp32 under
    mixed precision); fault: debug.shard_fault; reduce_dtype: the reduce-scatter's (None: the grad
    buffer's, master_dtype; the compute dtype only to prove validation catches it:
    debug.low_precision_reduce); decays: which parameters make_adamw's weight decay applies to (None:
    all, AdamW decays the whole shard itself); bucket_elements: parallel.zero_bucket_elements (0:
    Megatron's); late: the parameters of the last bucket, reduce-scattered at `reduce_scatter` only."""

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
        bucket_elements: int = 0,
        late: set[str] | frozenset[str] = frozenset(),
    ):
        self.params, self.group, self.fault = params, group, fault
        self.reduce_dtype = reduce_dtype or master_dtype
        self.dp = collectives.group_size(group)
        self.dp_rank = 0 if group is None else dist.get_rank(group)
        self.pure = master_dtype == param_dtype
        first = next(iter(params.values()))
        numels = {name: p.numel() for name, p in params.items()}
        self.buckets = plan_buckets(numels, set(late), bucket_cap(bucket_elements, self.dp), self.dp)
        padded = sum(b.numel for b in self.buckets)  # [P]
        self.shard_numel = padded // self.dp  # S = P / DP, over all the pieces
        self.param_buffer = torch.zeros(padded, dtype=param_dtype, device=first.device)  # [P]
        self.grad_buffer = torch.zeros(padded, dtype=master_dtype, device=first.device)  # [P]
        offsets: dict[str, int] = {}
        self.bucket_of: dict[str, int] = {}
        for i, bucket in enumerate(self.buckets):
            offset = bucket.start
            for name in bucket.names:
                offsets[name], self.bucket_of[name] = offset, i
                offset += numels[name]
        self.param_views: dict[str, torch.Tensor] = {}
        self.grad_views: dict[str, torch.Tensor] = {}
        for name, p in params.items():  # the views in the model's order, wherever they sit
            self.param_views[name] = self.param_buffer.narrow(0, offsets[name], p.numel()).view_as(p)
            self.grad_views[name] = self.grad_buffer.narrow(0, offsets[name], p.numel()).view_as(p)
        self.grad_shards = [self._mine(self.grad_buffer, i) for i in range(len(self.buckets))]  # [B_b/DP]
        with torch.no_grad():
            if self.pure:  # AdamW steps the param buffer's own pieces
                for name, p in params.items():
                    self.param_views[name].copy_(p)
                self.masters = [
                    nn.Parameter(self._mine(self.param_buffer, i)) for i in range(len(self.buckets))
                ]
            else:  # the fp32 master pieces from the weights as they come, then the bf16 param buffer
                for name, p in params.items():
                    self.grad_views[name].copy_(p)  # the grad buffer lends its [P] for a moment
                self.masters = [nn.Parameter(shard.clone()) for shard in self.grad_shards]
                self.grad_buffer.zero_()
                for name, p in params.items():
                    self.param_views[name].copy_(p)
        self.adamw = make_adamw(self.masters)
        # decays given: each piece's decayed spans, decayed here, and AdamW at weight decay 0
        self.weight_decay = 0.0
        self.decayed: list[list[tuple[int, int]]] = [[] for _ in self.buckets]
        if decays is not None:
            adamw_group = self.adamw.param_groups[0]
            self.weight_decay, adamw_group["weight_decay"] = adamw_group["weight_decay"], 0.0
            self.decayed = [self._decayed_spans(i, offsets, numels, decays) for i in range(len(self.buckets))]
        # the forward's order of the buckets: by the first parameter (in model order) each holds
        position = {name: i for i, name in enumerate(params)}
        self.forward_order = sorted(
            range(len(self.buckets)), key=lambda i: min(position[n] for n in self.buckets[i].names)
        )
        self.sync = True  # set_gradient_sync: whether this backward launches the reduce-scatters
        self.reduce_pending: list[collectives.Pending | None] = [None] * len(self.buckets)
        self.gather_pending: list[collectives.Pending | None] = [None] * len(self.buckets)
        self.missing = [len(b.names) for b in self.buckets]
        for name, p in params.items():
            p.data = self.param_views[name]  # the model's weights live in the param buffer
            p.register_post_accumulate_grad_hook(lambda p, name=name: self.ready(name))

    # --- the layout -------------------------------------------------------------------------------

    def _piece(self, i: int) -> tuple[int, int]:
        """(start in [P], elements) of this rank's piece of bucket i."""
        bucket = self.buckets[i]
        n = bucket.numel // self.dp
        return bucket.start + self.dp_rank * n, n

    def _mine(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's piece of bucket i of a flat [P] tensor: [B_i/DP], a view."""
        return flat.narrow(0, *self._piece(i))

    def _decayed_spans(self, i, offsets, numels, decays) -> list[tuple[int, int]]:
        """(start, elements) in piece i of the decayed parameters' parts, contiguous ones merged."""
        lo, n = self._piece(i)
        spans: list[tuple[int, int]] = []
        for name in self.buckets[i].names:
            if not decays(name):
                continue
            start, end = max(offsets[name], lo), min(offsets[name] + numels[name], lo + n)
            if start >= end:
                continue
            if spans and spans[-1][0] + spans[-1][1] == start - lo:
                spans[-1] = (spans[-1][0], spans[-1][1] + end - start)
            else:
                spans.append((start - lo, end - start))
        return spans

    def _overlap(self, name: str) -> tuple[int, int, int] | None:
        """(bucket, start in the parameter, elements) of parameter `name`'s part in this rank's piece of
        its bucket; None where it has none."""
        i = self.bucket_of[name]
        lo, n = self._piece(i)
        base = self.grad_buffer.storage_offset()
        start = self.grad_views[name].storage_offset() - base
        first, last = max(start, lo), min(start + self.grad_views[name].numel(), lo + n)
        return (i, first - start, last - first) if first < last else None

    def pieces_of(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each parameter's part of per-bucket pieces `shards` (as grad_shards), a flat view (empty where
        it has none in this rank's pieces), in the model's order."""
        out = {}
        for name in self.params:
            where = self._overlap(name)
            if where is None:
                out[name] = shards[self.bucket_of[name]][:0]
                continue
            i, first, n = where
            lo = self._piece(i)[0]
            start = self.grad_views[name].storage_offset() - self.grad_buffer.storage_offset() + first
            out[name] = shards[i].narrow(0, start - lo, n)
        return out

    # --- backward: the gradients into the buffer, the buckets' reduce-scatters --------------------

    def add_to_buffer(self, name: str) -> None:
        """Parameter `name`'s gradient of this backward, added into its slot of the grad buffer (zero
        at the step's start). Where the dtypes agree `.grad` becomes the slot's view and later
        accumulations add into it in place; else (bf16 gradients, fp32 buffer) `.grad` is freed."""
        p, view = self.params[name], self.grad_views[name]
        if p.grad is None or p.grad is view:  # not by data_ptr: a fake tensor's is its storage offset
            return
        view.add_(p.grad)
        p.grad = view if p.grad.dtype == view.dtype else None

    def ready(self, name: str) -> None:
        """Parameter `name` has its gradient of this backward: into the buffer and, on a backward that
        syncs, its bucket's reduce-scatter launched once the bucket's last gradient is in (the late
        bucket waits for `reduce_scatter`). debug.shard_fault=early_reduce_scatter: at its first."""
        self.add_to_buffer(name)
        i = self.bucket_of[name]
        if not self.sync or self.buckets[i].late:
            return
        self.missing[i] -= 1
        if self.missing[i] == 0 or self.fault == "early_reduce_scatter":
            self._launch_reduce_scatter(i)

    def _launch_reduce_scatter(self, i: int) -> None:
        """Bucket i's reduce-scatter, in place: grad bucket [B_i] -> its piece [B_i/DP], not waited."""
        if self.reduce_pending[i] is not None:
            return
        bucket, mine = self.buckets[i], self.grad_shards[i]
        for name in bucket.names:  # any gradient still in .grad (the late ones')
            self.add_to_buffer(name)
        whole = self.grad_buffer.narrow(0, bucket.start, bucket.numel)
        if self.fault == "no_reduce_scatter":  # this rank's own gradients, never averaged
            pending = collectives.Pending(mine)
        elif self.reduce_dtype == self.grad_buffer.dtype:
            pending = collectives.reduce_scatter_into_async(mine, whole, self.group, "dp_grads")
        else:  # debug.low_precision_reduce: sent in the compute dtype, back into the fp32 piece
            low = collectives.reduce_scatter_async(whole.to(self.reduce_dtype), self.group, "dp_grads")
            pending = collectives.Pending(mine, lambda: mine.copy_(low.wait()))
        self.reduce_pending[i] = pending
        if self.fault == "early_reduce_scatter":  # done before the bucket's later gradients come
            pending.wait()

    def set_gradient_sync(self, on: bool) -> None:
        """Whether the next backward launches the buckets' reduce-scatters (train.accumulation: the
        last micro-batch's only)."""
        self.sync = on

    def gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient slot, after sweeping in any gradient still in `.grad` (none
        once ZeroModel hands parallel.overlap's deferred ones in as they are made)."""
        for name in self.params:
            self.add_to_buffer(name)
        return self.grad_views

    def reduce_scatter(self) -> None:
        """The DP average of the gradients into this rank's pieces: the buckets not launched yet (the
        late one, after the TP sums; any whose gradients did not all come) launched, every one waited,
        each piece averaged in place."""
        for i in range(len(self.buckets)):
            self._launch_reduce_scatter(i)
        self._wait_reduce_scatters(average=self.fault != "no_reduce_scatter")

    def _wait_reduce_scatters(self, average: bool) -> None:
        for i, pending in enumerate(self.reduce_pending):
            if pending is not None:
                pending.wait()
                if average:
                    self.grad_shards[i].div_(self.dp)
        self.reduce_pending = [None] * len(self.buckets)
        self.missing = [len(b.names) for b in self.buckets]

    @property
    def grad_shard(self) -> list[torch.Tensor]:
        """The gradient pieces AdamW steps (one per bucket, views of the grad buffer)."""
        return self.grad_shards

    @property
    def state(self) -> dict:
        """The AdamW state of the master pieces (their moments and steps)."""
        return self.adamw.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wait_reduce_scatters(average=False)  # a backward that never reached its finish_grads
        for p in self.params.values():
            p.grad = None
        self.grad_buffer.zero_()
        self.adamw.zero_grad(set_to_none=True)

    # --- the step, then the buckets' all-gathers --------------------------------------------------

    def step(self) -> None:
        """AdamW on the master pieces, then each bucket's all-gather launched (waited by the forward
        that needs it: `wait_gather`)."""
        for master, grad in zip(self.masters, self.grad_shards, strict=True):
            master.grad = grad.to(master.dtype)  # the piece itself: the dtypes agree
        if self.weight_decay:  # the decayed spans (groups), as AdamW would decay them
            lr = self.adamw.param_groups[0]["lr"]
            with torch.no_grad():
                for master, spans in zip(self.masters, self.decayed, strict=True):
                    for start, n in spans:
                        master.narrow(0, start, n).mul_(1 - lr * self.weight_decay)
        self.adamw.step()
        for master in self.masters:
            master.grad = None
        self.wait_params()  # none in flight here unless no forward ran since the last step
        for i in self.forward_order:
            bucket, mine = self.buckets[i], self._mine(self.param_buffer, i)
            if not self.pure:
                with torch.no_grad():
                    mine.copy_(self.masters[i].detach())  # fp32 -> the weights' dtype, in place
            if self.fault == "no_all_gather":  # the other ranks' pieces stay as they were
                continue
            whole = self.param_buffer.narrow(0, bucket.start, bucket.numel)
            self.gather_pending[i] = collectives.all_gather_into_async(whole, mine, self.group, "dp_params")

    def wait_gather(self, i: int) -> None:
        """Bucket i's all-gather of the last step, waited (the forward pre-hook's)."""
        pending, self.gather_pending[i] = self.gather_pending[i], None
        if pending is not None:
            pending.wait()

    def wait_params(self) -> None:
        """Every all-gather still in flight, waited: the weights complete for whoever reads them."""
        for i in range(len(self.buckets)):
            self.wait_gather(i)

    # --- for the checks ---------------------------------------------------------------------------

    def _whole(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Per-bucket pieces of every rank -> the [P] they make, laid out as the buffers (gathered over
        DP: for checks only, counted as `check`)."""
        gathered = collectives.all_gather(torch.cat([p.reshape(-1) for p in pieces]), self.group, "check")
        out = torch.empty(self.shard_numel * self.dp, dtype=gathered.dtype, device=gathered.device)
        offset = 0
        for bucket in self.buckets:
            n = bucket.numel // self.dp
            for r in range(self.dp):
                out.narrow(0, bucket.start + r * n, n).copy_(
                    gathered.narrow(0, r * self.shard_numel + offset, n)
                )
            offset += n
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's averaged gradient, the pieces all-gathered (for checks only: not counted
        as a step's)."""
        return self._unflatten(self._whole(self.grad_shards))

    def write_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        """Whole gradients (as full_gradients gives them): the part of each in this rank's pieces
        written into the pieces the step takes (validate's sign rule only; no collective)."""
        with torch.no_grad():
            for name, piece in self.pieces_of(self.grad_shards).items():
                where = self._overlap(name)
                if where is not None:
                    piece.copy_(grads[name].reshape(-1).narrow(0, where[1], where[2]))

    def full_masters(self) -> dict[str, torch.Tensor]:
        """Every parameter's master weights (fp32 under mixed precision), gathered as full_gradients."""
        return self._unflatten(self._whole([m.detach() for m in self.masters]))

    def shard_of(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Whole per-parameter tensors (shaped as the parameters: weights, AdamW moments) flattened
        as the buffers are, this rank's pieces of them in the master dtype, the padding zeros (copies;
        tpbench.experiments.optimizer_check)."""
        flat = torch.zeros_like(self.grad_buffer, dtype=self.masters[0].dtype)  # [P]
        base = self.grad_buffer.storage_offset()
        for name, view in self.grad_views.items():
            flat.narrow(0, view.storage_offset() - base, view.numel()).copy_(tensors[name].reshape(-1))
        return [self._mine(flat, i).clone() for i in range(len(self.buckets))]

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A [P] laid out as the buffers -> each parameter's view, shaped as the parameter."""
        base = self.grad_buffer.storage_offset()
        return {
            name: flat.narrow(0, view.storage_offset() - base, view.numel()).view_as(view)
            for name, view in self.grad_views.items()
        }


class ZeroModel:
    """A parallel model (tpbench.parallel.plan.ParallelModel: any TP mode, or the dense model at tp
    1) whose DP average is ZeRO-1's bucketed reduce-scatter instead of an all-reduce: the model's
    interface for training and the checks, with `optimizer` its DistributedOptimizer."""

    def __init__(
        self,
        pm,
        make_adamw: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        param_dtype: torch.dtype,
        master_dtype: torch.dtype,
        fault: str = "",
        reduce_dtype: torch.dtype | None = None,
        decays: Callable[[str], bool] | None = None,
        bucket_elements: int = 0,
    ):
        self.pm, self.module, self.ctx = pm, pm.module, pm.ctx
        pm.grad_sums = [gs for gs in pm.grad_sums if gs.name != "dp"]  # the reduce-scatters' now
        params = dict(self.module.named_parameters())
        self.optimizer = DistributedOptimizer(
            params, pm.ctx.dp_group, make_adamw, param_dtype, master_dtype, fault, reduce_dtype, decays,
            bucket_elements, pm.late_params(),
        )  # fmt: skip
        # parallel.overlap's deferred weight gradients (q, k, v, gate, up: made outside autograd, so
        # no hook sees them) go into the buffer as each is made, as autograd's do: under mixed
        # precision each micro-batch's bf16 gradient is summed in the fp32 buffer, never in bf16
        names = {id(p): name for name, p in params.items()}
        for deferred in pm.deferred:
            deferred.on_ready = lambda p: self.optimizer.ready(names[id(p)])
        self._hook_gathers(params)

    def _hook_gathers(self, params: dict[str, nn.Parameter]) -> None:
        """Forward pre-hooks that wait for the all-gathers of the buckets a module's parameters are in:
        each block's, and the embedding's, final norm's and head's own. A compiled block would trace
        its hook: under train.compile every all-gather is waited at the model's forward instead."""
        opt, model = self.optimizer, self.module
        if any(getattr(block, "_compiled_call_impl", None) is not None for block in model.model.layers):
            model.register_forward_pre_hook(lambda module, args: opt.wait_params())
            return
        units: dict[str, set[int]] = {}
        for name in params:
            parts = name.split(".")
            unit = ".".join(parts[:3]) if name.startswith("model.layers.") else ".".join(parts[:-1])
            units.setdefault(unit, set()).add(opt.bucket_of[name])
        for unit, buckets in units.items():
            order = tuple(i for i in opt.forward_order if i in buckets)
            model.get_submodule(unit).register_forward_pre_hook(_Waits(opt, order))

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.pm(input_ids, labels)

    def set_gradient_sync(self, on: bool) -> None:
        self.optimizer.set_gradient_sync(on)

    def wait_params(self) -> None:
        self.optimizer.wait_params()

    def finish_grads(self) -> None:
        """The TP gradient sums on the grad buffer's views (the late bucket's), then the late bucket's
        reduce-scatter and the wait for all."""
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
        self.optimizer.wait_params()
        return self.optimizer.full_masters()

    def semantics(self, name: str) -> str:
        return self.pm.semantics(name)

    def shard_like(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        return self.pm.shard_like(name, dense)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.pm.full_logits(logits)


class _Waits:
    """A forward pre-hook: the all-gathers of buckets `order` waited, in that order."""

    def __init__(self, opt: DistributedOptimizer, order: tuple[int, ...]):
        self.opt, self.order = opt, order

    def __call__(self, module: nn.Module, args: tuple) -> None:
        for i in self.order:
            self.opt.wait_gather(i)
