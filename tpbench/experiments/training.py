"""One training step, the same for every engine, so memory and throughput measure like with like.

Engines: `ddp` (torch DistributedDataParallel over the dense model, the baseline), `megatron` (ours),
`dtensor` (PyTorch's parallelize_module). Seeded random token batches, AdamW.
AdamW's weight-decay groups and lr schedule: tpbench.experiments.optim.
Precision: `pure` keeps parameters, gradients and optimizer state in train.dtype (as the seed measured);
`mixed` keeps fp32 masters and optimizer state and runs forward/backward under autocast(train.dtype).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tpbench.config import RunConfig
from tpbench.experiments import optim
from tpbench.experiments.optim import adamw
from tpbench.experiments.setup import (
    Batches,
    build_dense,
    build_parallel,
    context,
    param_dtype,
    place,
    precision,
)
from tpbench.models.minimind import DTYPES, MiniMindForCausalLM
from tpbench.parallel import clip, collectives, instrumentation
from tpbench.parallel.compiled import apply_compile
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.plan import ParallelModel, write_in_place
from tpbench.parallel.recompute import apply_recompute
from tpbench.parallel.rng import place_dropouts
from tpbench.parallel.zero import DistributedOptimizer, ZeroModel


class Trainer:
    """The model of the run's engine on this rank, its optimizer and its batches.

    on_device: called with the module once its parameters are on the device, before DDP wraps it and
    before the optimizer exists (an emulated GPU rank starts its allocation trace there)."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: ParallelContext | None = None,
        on_device: Callable[[torch.nn.Module], None] = lambda module: None,
    ):
        self.cfg = cfg
        self.ctx: ParallelContext = ctx or context(cfg)
        self.batches = Batches(cfg, self.ctx)
        if cfg.parallel.engine == "ddp" and cfg.parallel.dp_shard == "none":
            self.model, self.ddp_state = build_ddp(cfg, self.ctx, on_device)
            self.module = self.model.module
            self.finish_grads = lambda: None  # DDP all-reduces in backward
        else:
            pm = build_parallel(cfg, self.ctx)
            on_device(pm.module)
            pm = shard_data_parallel(cfg, pm, cfg.train.lr)
            self.model, self.module, self.finish_grads = pm, pm.module, pm.finish_grads
        self.steps = self.skipped_steps = 0  # the steps clip_grads saw, and those it skipped
        self._hidden: list[torch.Tensor] = []
        if cfg.train.keep_output:
            self.module.model.register_forward_hook(self._keep_hidden)
        self.optimizer = optimizer(cfg, self.model, cfg.train.lr)
        # train.lr_scheduler over the steps the run takes (None: a constant lr)
        torch_adamw = getattr(self.optimizer, "adamw", self.optimizer)  # ZeRO-1's AdamW of its shard
        horizon = cfg.train.warmup + cfg.train.steps
        self.scheduler = optim.scheduler(cfg.train, torch_adamw, horizon, cfg.debug.optim_fault)

    def tracked(self) -> list:
        """What a memory tracker must see beside the module's tensors: the optimizer (ZeRO-1's own
        AdamW, the master pieces it steps, which no module holds, and its grad buffer, which under
        mixed precision no `.grad` is a view of) and DDP's buckets."""
        if isinstance(self.model, ZeroModel):
            return [self.optimizer.adamw, *self.optimizer.masters, self.optimizer.grad_buffer]
        return [self.optimizer, *self.ddp_buckets()]

    def ddp_buckets(self) -> list[torch.Tensor]:
        """DDP's gradient buckets that no module or optimizer holds: all of them, unless the
        gradients are views of them (none for the other engines)."""
        state = getattr(self, "ddp_state", None)
        if state is None or self.cfg.parallel.ddp_gradient_as_bucket_view:
            return []
        return list(state.buckets.values())

    def step(self) -> torch.Tensor:
        """One optimizer step on the next batch: train.accumulation micro-batches, each one's loss
        divided by their count (their mean, as one batch K times as large), one DP gradient sync at
        the last; returns the mean loss (a tensor: reading it would sync)."""
        ids, labels = self.batches.next_local()
        k = self.cfg.train.accumulation
        self.optimizer.zero_grad(set_to_none=True)
        kept, losses = [], []  # train.keep_output: each micro-batch's output lives to the step's end
        for i in range(k):
            if k > 1:
                set_gradient_sync(self.model, i == k - 1)
            micro_ids, micro_labels = self.batches.micro(ids, i), self.batches.micro(labels, i)
            with precision(self.cfg, self.ctx.device):
                if self.cfg.train.loss == "logits_mean":  # the seed's memory benchmark
                    output = self.model(micro_ids)
                    loss = output[0].float().mean()
                else:
                    output = self.model(micro_ids, micro_labels)
                    loss = output[1]
            if self.cfg.train.keep_output:
                kept.append(output)
            del output  # without keep_output the logits are dropped here, not kept through backward
            (loss / k if k > 1 else loss).backward()
            losses.append(loss.detach())
        self.finish_grads()
        if not self.clip_grads():  # train.grad_clip_nonfinite=skip: no optimizer step this time
            self._hidden.clear()
            return losses[0] if k == 1 else torch.stack(losses).mean()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self._hidden.clear()  # train.keep_output: the final hidden states live as long as the output
        del kept
        return losses[0] if k == 1 else torch.stack(losses).mean()

    def clip_grads(self) -> bool:
        """train.grad_clip: the accumulated, summed gradients clipped to their global norm
        (tpbench.parallel.clip) before the optimizer steps. A non-finite norm fails the run
        (train.grad_clip_nonfinite=error) or skips the step (skip: counted in `skipped_steps`, said on
        stderr). Returns whether the optimizer steps."""
        t, fault = self.cfg.train, self.cfg.debug.clip_fault
        if t.grad_clip <= 0:
            return True
        if fault == "nonfinite":
            clip.plant_nonfinite(self.model)
        norm = clip.global_norm(self.model, fault)
        self.steps += 1
        if not clip.finite(norm):
            self.skipped_steps += 1
            said = f"train.grad_clip: the global gradient norm is {norm.item()} at step {self.steps}"
            if t.grad_clip_nonfinite != "skip":
                raise clip.NonFiniteGradNorm(f"{said} (train.grad_clip_nonfinite=error)")
            print(f"{said}: its optimizer step skipped (train.grad_clip_nonfinite=skip)", file=sys.stderr)
            return False
        clip.scale(self.model, clip.coefficient(norm, t.grad_clip))
        return True

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, hidden: torch.Tensor) -> None:
        """The final hidden states the LM head takes ([S, B, H]; this rank's [S/T, B, H] under SP with
        VP, whose head gathers them itself), kept as the benchmarks' `output.hidden_states` keeps them."""
        self._hidden.append(hidden)

    def sync(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        dist.barrier()


def set_gradient_sync(model, on: bool) -> None:
    """Whether the next micro-batch's backward syncs the DP gradients (off for all but a step's
    last under train.accumulation): DDP's `no_sync` switch, and ZeRO-1's: its buckets' reduce-scatters
    launch in the last micro-batch's backward (tpbench.parallel.zero). Megatron's DP all-reduce runs
    in finish_grads, once a step, whatever this says; FSDP2 (tpbench.parallel.fsdp) syncs every
    micro-batch, its gradients kept sharded."""
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = on  # what DDP's no_sync() sets
    elif hasattr(model, "set_gradient_sync"):
        model.set_gradient_sync(on)


def build_ddp(
    cfg: RunConfig,
    ctx: ParallelContext,
    on_device: Callable[[torch.nn.Module], None] = lambda module: None,
) -> tuple[DistributedDataParallel, _DDPHookState]:
    """The `ddp` engine: torch's DistributedDataParallel over the dense model of the run's seed, its
    buckets of parallel.ddp_bucket_mb, its all-reduces counted by our comm hook (and broken by
    debug.ddp_fault, to prove that validation catches it). The one DDP that memory, throughput and
    validation run. on_device: as Trainer's."""
    p = cfg.parallel
    dense = place(build_dense(cfg), ctx.device, param_dtype(cfg))
    apply_recompute(dense, cfg.train.recompute)
    # each DP rank draws its slice of the global batch's masks
    place_dropouts(dense, 0, 1, ctx.dp_rank, ctx.dp, False, cfg.debug.dropout_fault)
    if cfg.train.compile is True:  # after recompute, before DDP wraps it (torchtitan's order)
        apply_compile(dense, backend=cfg.train.compile_backend)
    on_device(dense)
    fake = collectives.fake_backend(ctx.dp_group)
    ddp = DistributedDataParallel(
        dense,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        process_group=ctx.dp_group,
        bucket_cap_mb=p.ddp_bucket_mb,
        gradient_as_bucket_view=p.ddp_gradient_as_bucket_view,
        init_sync=not fake,  # an emulated rank has no one to agree with, nor values to send
    )
    low = cfg.debug.low_precision_reduce and cfg.train.precision == "mixed"
    state = _DDPHookState(ctx.dp_group, cfg.debug.ddp_fault, DTYPES[cfg.train.dtype] if low else None)
    ddp.register_comm_hook(state, _counted_allreduce)
    if fake and cfg.launch.emulate == "fake":
        ddp.reducer = _KeepBuckets(ddp.reducer)
    return ddp, state


def shard_data_parallel(cfg: RunConfig, pm: ParallelModel, lr: float):
    """`pm` with its DP dimension sharded as parallel.dp_shard says (none: `pm` itself, whose DP
    average is an all-reduce): optimizer, ZeRO-1 (tpbench.parallel.zero); grads and full, FSDP2
    (tpbench.parallel.fsdp). lr: the AdamW's that ZeRO-1's optimizer steps with."""
    level = cfg.parallel.dp_shard
    if level == "none":
        return pm
    low = cfg.debug.low_precision_reduce
    if level == "optimizer":
        mixed = cfg.train.precision == "mixed"
        weights = DTYPES[cfg.train.dtype] if mixed else param_dtype(cfg)
        master = torch.float32 if mixed else weights
        make = lambda params: adamw(cfg, params, lr)  # noqa: E731
        decays = optim.decay_rule(cfg)  # the weight-decay groups, if any: decayed parameters first
        return ZeroModel(
            pm, make, weights, master, cfg.debug.shard_fault, weights if low else None, decays,
            cfg.parallel.zero_bucket_elements,
        )  # fmt: skip
    from tpbench.parallel.fsdp import FSDPModel

    return FSDPModel(pm, cfg.parallel, cfg.train, cfg.debug.shard_fault, low)


def optimizer(cfg: RunConfig, model, lr: float) -> torch.optim.Optimizer | DistributedOptimizer:
    """The run's optimizer of `model`: AdamW (`adamw`) over its parameters in their weight-decay
    groups (tpbench.experiments.optim), or ZeRO-1's own."""
    if isinstance(model, ZeroModel):
        return model.optimizer
    # torch's own named_parameters: the dtensor engine's yields local copies, for the checks
    named = torch.nn.Module.named_parameters(model.module if hasattr(model, "module") else model)
    return adamw(cfg, optim.param_groups(named, cfg.train, cfg.debug.optim_fault), lr)


class _KeepBuckets:
    """DDP's reducer, except that it keeps its first buckets: rebuilding them after the first backward
    reads bucket indices back from a broadcast, and a fake tensor has no values. The buckets hold the
    same gradients either way, in another order (so DDP's all-reduces are as many bytes)."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)


@dataclass
class _DDPHookState:
    group: dist.ProcessGroup | None
    fault: str = ""  # debug.ddp_fault
    reduce_dtype: torch.dtype | None = None  # debug.low_precision_reduce: the compute dtype, not fp32
    buckets: dict[int, torch.Tensor] = field(default_factory=dict)  # DDP's flat bucket buffers
    timed: list[collectives.Pending] = field(default_factory=list)  # this backward's, in a timed step

    def wait_timed(self) -> None:
        pending, self.timed = self.timed, []
        for p in pending:
            p.wait()


def _counted_allreduce(state, bucket):  # no annotations: DDP checks them and ours are strings
    """DDP's own asynchronous all-reduce of a gradient bucket (averaged), through collectives: counted, and
    in a timed step timed as our engine's async collectives are, waited on where DDP waits for them:
    the last bucket's hook queues the wait as an autograd final callback, which runs just before
    the one DDP queues right after this hook (its finalize_backward, which waits on every bucket).
    Keeps the bucket's buffer: a memory tracker must see it (unless the gradients are views of it,
    DDP's buckets are tensors no module or optimizer holds).

    debug.ddp_fault: no_divide sums the bucket without averaging it; drop_bucket leaves bucket 0
    (DDP's first: all the gradients until its buckets are rebuilt after the first backward) as this
    rank's own gradients, never all-reduced."""
    group = state.group
    state.buckets[bucket.index()] = bucket.buffer()
    if state.fault == "drop_bucket" and bucket.index() == 0:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    buffer = bucket.buffer()
    if state.fault != "no_divide":
        buffer.div_(dist.get_world_size(group))
    if state.reduce_dtype is not None:  # debug.low_precision_reduce: summed in bf16, back in fp32
        low = buffer.to(state.reduce_dtype)
        collectives.all_reduce(low, group, "dp_grads")
        buffer.copy_(low)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
    pending, future = collectives.all_reduce_bucket(buffer, group, "dp_grads")
    if instrumentation.timed():
        state.timed.append(pending)
        if bucket.is_last():
            torch.autograd.Variable._execution_engine.queue_callback(state.wait_timed)
    return future


class DDPModel:
    """The `ddp` engine as the checks take a parallel model: build_ddp's DistributedDataParallel, the
    one memory and throughput measure. Nothing is sharded (each rank holds the dense model and takes
    its DP slice of the batch); DDP's comm hook averages the gradients during backward."""

    def __init__(self, cfg: RunConfig, ctx: ParallelContext):
        self.ddp, _ = build_ddp(cfg, ctx)
        self.module: MiniMindForCausalLM = self.ddp.module

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.ddp(input_ids, labels)

    def set_gradient_sync(self, on: bool) -> None:
        self.ddp.require_backward_grad_sync = on  # what DDP's no_sync() sets

    def finish_grads(self) -> None:
        """Nothing left: DDP waits for its buckets' all-reduces before backward returns."""

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.module.named_parameters()}

    def write_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        write_in_place(self.full_gradients(), grads)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def semantics(self, name: str) -> str:
        return "replicated"

    def shard_like(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        return dense.detach()

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
