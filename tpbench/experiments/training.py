"""One training step, the same for every engine, so memory and throughput measure like with like.

Engines: `ddp` (torch DistributedDataParallel over the dense model, the baseline), `megatron` (ours),
`dtensor` (PyTorch's parallelize_module). Seeded random token batches, AdamW.
Precision: `pure` keeps parameters, gradients and optimizer state in train.dtype (as the seed measured);
`mixed` keeps fp32 masters and optimizer state and runs forward/backward under autocast(train.dtype).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tpbench.config import RunConfig
from tpbench.experiments.setup import (
    Batches,
    build_dense,
    build_parallel,
    context,
    counting,
    param_dtype,
    precision,
)
from tpbench.parallel import comm
from tpbench.parallel.context import ParallelContext


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.ctx: ParallelContext = context(cfg)
        self.batches = Batches(cfg, self.ctx)
        if cfg.parallel.engine == "ddp":
            self.model, self.module = self._ddp()
            self.finish_grads = lambda: None  # DDP all-reduces in backward
        else:
            pm = build_parallel(cfg, self.ctx)
            self.model, self.module, self.finish_grads = pm, pm.module, pm.finish_grads
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )

    def _ddp(self):
        p = self.cfg.parallel
        dense = build_dense(self.cfg).to(device=self.ctx.device, dtype=param_dtype(self.cfg))
        ddp = DistributedDataParallel(
            dense,
            device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
            process_group=self.ctx.dp_group,
            bucket_cap_mb=p.ddp_bucket_mb,
            gradient_as_bucket_view=p.ddp_gradient_as_bucket_view,
        )
        ddp.register_comm_hook(self.ctx.dp_group, _counted_allreduce)
        return ddp, dense

    def step(self) -> float:
        """One optimizer step on the next batch; returns the loss."""
        ids, labels = self.batches.next_local()
        self.optimizer.zero_grad(set_to_none=True)
        with precision(self.cfg, self.ctx.device):
            _, loss = self.model(ids, labels)
        loss.backward()
        self.finish_grads()
        self.optimizer.step()
        return loss.item()

    def counted_step(self) -> list:
        """One step with its collectives counted: CommRows per step."""
        counter = comm.CommCounter()
        with counting(self.cfg, counter):
            self.step()
        return counter.rows()

    def sync(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        dist.barrier()


def _counted_allreduce(group, bucket):  # no annotations: DDP checks them and ours are strings
    """DDP's own asynchronous all-reduce of a gradient bucket (averaged), reported to the counter."""
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    comm.record_async("all_reduce", "dp_grad", buffer, group)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
