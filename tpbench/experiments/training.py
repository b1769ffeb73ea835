"""One training step, the same for every engine, so memory and throughput measure like with like.

Engines: `ddp` (torch DistributedDataParallel over the dense model, the baseline), `megatron` (ours),
`dtensor` (PyTorch's parallelize_module). Seeded random token batches, AdamW.
Precision: `pure` keeps parameters, gradients and optimizer state in train.dtype (as the seed measured);
`mixed` keeps fp32 masters and optimizer state and runs forward/backward under autocast(train.dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from tpbench.config import RunConfig
from tpbench.experiments.setup import (
    Batches,
    build_dense,
    build_parallel,
    context,
    param_dtype,
    place,
    precision,
)
from tpbench.parallel import comm
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.recompute import apply_recompute


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
        if cfg.parallel.engine == "ddp":
            self.model, self.module = self._ddp(on_device)
            self.finish_grads = lambda: None  # DDP all-reduces in backward
        else:
            pm = build_parallel(cfg, self.ctx)
            on_device(pm.module)
            self.model, self.module, self.finish_grads = pm, pm.module, pm.finish_grads
        self._hidden: list[torch.Tensor] = []
        if cfg.train.keep_output:
            self.module.model.register_forward_hook(self._keep_hidden)
        self.optimizer = adamw(cfg, self.module.parameters(), cfg.train.lr)

    def ddp_buckets(self) -> list[torch.Tensor]:
        """DDP's gradient buckets that no module or optimizer holds: all of them, unless the
        gradients are views of them (none for the other engines)."""
        state = getattr(self, "ddp_state", None)
        if state is None or self.cfg.parallel.ddp_gradient_as_bucket_view:
            return []
        return list(state.buckets.values())

    def _ddp(self, on_device: Callable[[torch.nn.Module], None]):
        p = self.cfg.parallel
        dense = place(build_dense(self.cfg), self.ctx.device, param_dtype(self.cfg))
        apply_recompute(dense, self.cfg.train.recompute)
        on_device(dense)
        fake = fake_backend(self.ctx.dp_group)
        ddp = DistributedDataParallel(
            dense,
            device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
            process_group=self.ctx.dp_group,
            bucket_cap_mb=p.ddp_bucket_mb,
            gradient_as_bucket_view=p.ddp_gradient_as_bucket_view,
            init_sync=not fake,  # an emulated rank has no one to agree with, nor values to send
        )
        self.ddp_state = _DDPHookState(self.ctx.dp_group)
        ddp.register_comm_hook(self.ddp_state, _counted_allreduce)
        if fake and self.cfg.launch.emulate == "fake":
            ddp.reducer = _KeepBuckets(ddp.reducer)
        return ddp, dense

    def step(self) -> torch.Tensor:
        """One optimizer step on the next batch; returns the loss (a tensor: reading it would sync)."""
        ids, labels = self.batches.next_local()
        self.optimizer.zero_grad(set_to_none=True)
        with precision(self.cfg, self.ctx.device):
            if self.cfg.train.loss == "logits_mean":  # the seed's memory benchmark
                output = self.model(ids)
                loss = output[0].float().mean()
            else:
                output = self.model(ids, labels)
                loss = output[1]
        if not self.cfg.train.keep_output:  # the logits are dropped here, not kept through backward
            del output
        loss.backward()
        self.finish_grads()
        self.optimizer.step()
        self._hidden.clear()  # train.keep_output: the final hidden states live as long as the output
        return loss.detach()

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, hidden: torch.Tensor) -> None:
        """The final hidden states the LM head takes ([S, B, H]; this rank's [S/T, B, H] under SP with
        VP, whose head gathers them itself), kept as the benchmarks' `output.hidden_states` keeps them."""
        self._hidden.append(hidden)

    def sync(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        dist.barrier()


def adamw(cfg: RunConfig, params, lr: float) -> torch.optim.AdamW:
    """The run's AdamW: fused under train.fused_optimizer; else foreach, AdamW's default for CUDA
    tensors, said here for an emulated GPU rank. Both take a group's tensors in one op, which cannot mix
    DTensors with plain tensors (the dtensor engine's replicated embedding beside its shards without
    VP): those are two parameter groups."""
    params = list(params)
    groups = [g for g in (_plain(params, True), _plain(params, False)) if g]
    kinds = [{"params": g} for g in groups] if len(groups) > 1 else params
    if cfg.train.fused_optimizer:
        return torch.optim.AdamW(kinds, lr=lr, weight_decay=cfg.train.weight_decay, fused=True)
    foreach = True if cfg.launch.device == "cuda" else None
    return torch.optim.AdamW(kinds, lr=lr, weight_decay=cfg.train.weight_decay, foreach=foreach)


def _plain(params: list[torch.Tensor], plain: bool) -> list[torch.Tensor]:
    return [p for p in params if isinstance(p, DTensor) != plain]


def fake_backend(group: dist.ProcessGroup | None) -> bool:
    """torch's fake process group: "fake", or for one device only ("cuda:fake" refuses CPU tensors, as
    NCCL does: tests/fake_cuda_checks.py)."""
    return dist.get_backend(group).split(":")[-1] == "fake"


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
    buckets: dict[int, torch.Tensor] = field(default_factory=dict)  # DDP's flat bucket buffers


def _counted_allreduce(state, bucket):  # no annotations: DDP checks them and ours are strings
    """DDP's own asynchronous all-reduce of a gradient bucket (averaged), reported to the counter.
    Keeps the bucket's buffer: a memory tracker must see it (unless the gradients are views of it,
    DDP's buckets are tensors no module or optimizer holds)."""
    group = state.group
    state.buckets[bucket.index()] = bucket.buffer()
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    comm.record_async("all_reduce", "dp_grad", buffer, group)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    if fake_backend(group):  # an emulated rank: the fake work's future holds no value
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
    return work.get_future().then(lambda fut: fut.value()[0])
