"""What every experiment builds the same way: the mesh, the models, the batches."""

from __future__ import annotations

import contextlib
import copy
from contextlib import AbstractContextManager
from dataclasses import asdict
from datetime import timedelta

import torch

from tpbench.config import RunConfig, local_batch
from tpbench.models.minimind import IGNORE_INDEX, MiniMindConfig, MiniMindForCausalLM, build_model
from tpbench.parallel import comm
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.plan import ParallelModel, parallelize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config(cfg: RunConfig) -> MiniMindConfig:
    fields = asdict(cfg.model)
    fields.pop("name")
    return MiniMindConfig(**fields)


def context(cfg: RunConfig) -> ParallelContext:
    timeout = timedelta(seconds=cfg.launch.collective_timeout_s)
    return ParallelContext.from_world(cfg.parallel.tp, cfg.parallel.dp, cfg.launch.device, timeout)


def param_dtype(cfg: RunConfig) -> torch.dtype:
    """Pure precision keeps parameters in train.dtype; mixed keeps fp32 masters."""
    return DTYPES[cfg.train.dtype] if cfg.train.precision == "pure" else torch.float32


def precision(cfg: RunConfig, device: torch.device) -> AbstractContextManager:
    """What forward runs under: autocast(train.dtype) for mixed precision, nothing for pure."""
    if cfg.train.precision == "mixed":
        return torch.autocast(device.type, dtype=DTYPES[cfg.train.dtype])
    return contextlib.nullcontext()


def build_dense(cfg: RunConfig) -> MiniMindForCausalLM:
    return build_model(model_config(cfg), seed=cfg.train.seed)


def build_parallel(
    cfg: RunConfig, ctx: ParallelContext, dense: MiniMindForCausalLM | None = None
) -> ParallelModel:
    """The parallel model of `parallel.engine`, sharded from the dense model of the same seed (so it is
    the same model for every tp)."""
    model = copy.deepcopy(dense) if dense is not None else build_dense(cfg)
    if cfg.parallel.engine == "dtensor":
        from tpbench.parallel.dtensor import parallelize_dtensor

        pm = parallelize_dtensor(model, ctx, cfg.parallel, tuple(cfg.debug.skip_grad_sum))
    else:
        pm = parallelize(model, ctx, cfg.parallel, tuple(cfg.debug.skip_grad_sum))
    pm.module.to(device=ctx.device, dtype=param_dtype(cfg))
    return pm


def counting(cfg: RunConfig, counter: comm.CommCounter) -> AbstractContextManager:
    """Count the collectives of a training step: ours go through tpbench.parallel.comm; DTensor's
    own are seen through torch's CommDebugMode."""
    if cfg.parallel.engine == "dtensor":
        from tpbench.parallel import dtensor

        return dtensor.counting(counter)
    return comm.counting(counter)


class Batches:
    """Seeded random token batches of the global batch; each DP rank takes its slice.
    A fixed pattern of ignored labels (every 7th position) exercises ignore_index with the same
    number of valid tokens in every sequence, so DP's average of local means is the global mean."""

    def __init__(self, cfg: RunConfig, ctx: ParallelContext, seed_offset: int = 1):
        self.vocab = cfg.model.vocab_size
        self.seq = cfg.train.seq_len
        self.local = local_batch(cfg)
        self.dp, self.dp_rank = ctx.dp, ctx.dp_rank
        self.device = ctx.device
        self.gen = torch.Generator().manual_seed(cfg.train.seed + seed_offset)

    def next_global(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(self.vocab, (self.local * self.dp, self.seq), generator=self.gen)
        labels = ids.clone()
        labels[:, 3::7] = IGNORE_INDEX
        return ids.to(self.device), labels.to(self.device)

    def local_slice(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.dp_rank * self.local : (self.dp_rank + 1) * self.local]

    def next_local(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = self.next_global()
        return self.local_slice(ids), self.local_slice(labels)
