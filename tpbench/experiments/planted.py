"""The faults kind=validate plants on purpose, to prove that validation catches each one
(tpbench.experiments.validate): debug.validate_fault, the gradient scales (debug.grad_scale,
row_grad_scale, head_grad_scale) and, from debug.from_step on, debug.skip_grad_sum. debug.optim_fault, the
sharded side's AdamW decaying a norm or scheduled a step ahead, is planted where its groups and
schedule are built (tpbench.experiments.optim).

debug.from_step=N: the gradient scales and the skipped gradient sums act from step N of the AdamW
steps on (the forward check's pass is step 1's), so a bug that starts late must fail at the step it
starts (issue 56): the sharded model is built with every sum, and the skipped ones are taken out as
step N starts (`start_step`)."""

from __future__ import annotations

from dataclasses import replace

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
# debug.row_grad_scale's vocabulary row (of the embedding and the LM head): a token of every model's
# vocabulary, on TP rank 0 under VP
ROW = 3
# debug.head_grad_scale's attention head: its head_dim rows of SCALED (layer 0's q_proj), on TP rank 0
HEAD = 1
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")  # tied: the embedding's name alone


def plant_error(cfg: RunConfig, pm: ParallelModel | DDPModel) -> None:
    """debug.validate_fault=rank1_param: rank 1 adds 1 to its copy of model.norm.weight (replicated in
    every mode, so no other rank's figures hold it), to prove that its figures count."""
    if cfg.debug.validate_fault == "rank1_param" and dist.get_rank() == 1:
        getattr(pm, "wait_params", lambda: None)()  # ZeRO-1: no all-gather still writing the weights
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


def built(cfg: RunConfig) -> RunConfig:
    """The config the sharded model is built from: with debug.from_step > 1, every gradient sum
    (`start_step` takes the skipped ones out at that step)."""
    if cfg.debug.from_step > 1 and cfg.debug.skip_grad_sum:
        return replace(cfg, debug=replace(cfg.debug, skip_grad_sum=[]))
    return cfg


def start_step(cfg: RunConfig, pm, step: int) -> None:
    """At step debug.from_step (> 1): debug.skip_grad_sum's sums taken out of the sharded model."""
    skip = set(cfg.debug.skip_grad_sum)
    if step != cfg.debug.from_step or step == 1 or not skip:
        return
    inner = getattr(pm, "pm", pm)  # ZeRO-1 and FSDP2 wrap a parallel model
    if not hasattr(inner, "grad_sums"):  # the DTensor engine: its own list of skipped sums
        inner.skip_grad_sum = (*inner.skip_grad_sum, *skip)
        return
    for gs in inner.grad_sums:  # sums over one group share an all-reduce: keep the others' parameters
        gs.params = [n for n in gs.params if inner.layouts[n].grad_sum not in skip]
    inner.grad_sums = [gs for gs in inner.grad_sums if gs.params and gs.name not in skip]


def scale_grad(cfg: RunConfig, pm, dense: torch.nn.Module, step: int) -> None:
    """The gradient scales, on every rank after the gradient sums, from debug.from_step on, where the
    optimizer reads the gradient (pm.write_gradients): debug.grad_scale the whole of SCALED (a
    relative error of |scale - 1|), head_grad_scale head HEAD's rows of it, row_grad_scale row ROW
    of the embedding and the LM head. 1: none."""
    d = cfg.debug
    if step < d.from_step:
        return
    shapes = {n: p.shape for n, p in dense.named_parameters()}
    deltas: dict[str, torch.Tensor] = {}  # factor - 1, dense-shaped: a padded row's is 0

    def delta(name: str) -> torch.Tensor:
        return deltas.setdefault(name, torch.zeros(shapes[name], dtype=torch.float64))

    if d.grad_scale != 1.0:
        delta(SCALED).add_(d.grad_scale - 1)
    if d.head_grad_scale != 1.0:
        head_dim = dense.config.head_dim
        delta(SCALED)[HEAD * head_dim : (HEAD + 1) * head_dim].add_(d.head_grad_scale - 1)
    if d.row_grad_scale != 1.0:
        for name in VOCAB:
            if name in shapes:
                delta(name)[ROW].add_(d.row_grad_scale - 1)
    if not deltas:
        return
    grads = pm.full_gradients()
    scaled = {}
    for name, change in deltas.items():
        factor = 1 + pm.shard_like(name, change).to(grads[name].device)
        scaled[name] = (grads[name].double() * factor).to(grads[name].dtype)
    pm.write_gradients(scaled)


def _raise_in_forward(module: torch.nn.Module, args: tuple) -> None:
    raise RuntimeError("debug.validate_fault=raise_in_forward: rank 1 raised on purpose")
