"""The faults kind=validate plants on purpose, to prove that validation catches each one
(tpbench.experiments.validate): debug.validate_fault and debug.grad_scale."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpbench.config import RunConfig
from tpbench.experiments.training import DDPModel
from tpbench.parallel import collectives, regions
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.plan import ParallelModel
from tpbench.parallel.wrappers import Boundary, SPGather, TPCopy

# The parameter whose gradient debug.grad_scale scales: a column shard in every tensor-parallel mode
SCALED = "model.layers.0.self_attn.q_proj.weight"


def plant_error(cfg: RunConfig, pm: ParallelModel | DDPModel) -> None:
    """debug.validate_fault=rank1_param: rank 1 adds 1 to its copy of model.norm.weight (replicated in
    every mode, so no other rank's figures hold it), to prove that its figures count."""
    if cfg.debug.validate_fault == "rank1_param" and dist.get_rank() == 1:
        with torch.no_grad():
            dict(pm.module.named_parameters())["model.norm.weight"].view(-1)[0].add_(1.0)


class _NoBackwardSum(Boundary):
    """debug.validate_fault=no_backward_sum: a region entered without its backward collective (the
    all-reduce of f under TP; under SP the all-gather stays and backward keeps this rank's part, no
    reduce-scatter)."""

    def __init__(self, group: collectives.Group, sp: bool):
        super().__init__()
        self.group, self.sp = group, sp

    def forward(self, x: torch.Tensor, body) -> torch.Tensor:
        return body(regions.gather_from_sp_region_replicated(x, self.group) if self.sp else x)


def plant_model_fault(cfg: RunConfig, pm: ParallelModel | DDPModel, ctx: ParallelContext) -> None:
    """The validate faults planted in the model before its first forward, to prove validation catches
    them: rope_offset (tensor-parallel rank 1, or DP rank 1 without TP, computes RoPE one position
    off), no_backward_sum (the first region entered under TP or SP has no backward collective) and
    raise_in_forward (rank 1's model raises as its forward starts: a run that ends its job)."""
    fault = cfg.debug.validate_fault
    if fault == "raise_in_forward" and dist.get_rank() == 1:
        pm.module.register_forward_pre_hook(_raise_in_forward)
    if fault == "rope_offset" and (ctx.tp_rank if ctx.tp > 1 else ctx.dp_rank) == 1:
        decoder, rope = pm.module.model, pm.module.model.rope
        decoder.rope = lambda seq_len, device: tuple(t.roll(1, 0) for t in rope(seq_len, device))
    if fault == "no_backward_sum":
        for module in pm.module.modules():
            entry = module._modules.get("entry")
            if isinstance(entry, TPCopy | SPGather):
                module._modules["entry"] = _NoBackwardSum(entry.group, isinstance(entry, SPGather))
                return


def scale_grad(cfg: RunConfig, pm: ParallelModel | DDPModel) -> None:
    """debug.grad_scale: the gradient of SCALED multiplied by it on every rank after the gradient sums,
    a relative gradient error of |scale - 1| (1: none)."""
    if cfg.debug.grad_scale != 1.0:
        dict(pm.module.named_parameters())[SCALED].grad.mul_(cfg.debug.grad_scale)


def _raise_in_forward(module: torch.nn.Module, args: tuple) -> None:
    raise RuntimeError("debug.validate_fault=raise_in_forward: rank 1 raised on purpose")
