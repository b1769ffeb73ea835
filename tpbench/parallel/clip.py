"""Gradient clipping over TP, SP and DP (`train.grad_clip`): the global norm the dense model's
`torch.nn.utils.clip_grad_norm_` would compute over the whole model, from this rank's shards.

    ||g||^2 = sum over parameters of the squares of its gradient, each element once

Each rank sums the squares of what it holds and counts: a TP-sharded gradient (column, row, vocab)
its shard; a replicated one (norm weights, an embedding or head without VP) on TP rank 0 only; a KV
head replicated over T / N_kv ranks (N_kv < T) on the first rank of its replicas; under a sharded DP
level the DP shard of each (ZeRO-1's gradient pieces after their reduce-scatters, FSDP2's sharded
DTensor gradients, HSDP's shard group: its replicas hold the same shard). Then one fp32 scalar is
all-reduced over TP, and over the DP shard group where DP shards the gradients (`grad_norm`, counted
by tpbench.parallel.collectives): DDP's and the all-reduce's gradients are the same on every DP rank.

The squares are summed in fp32 in every precision: mixed precision's gradients are fp32 already,
and a pure bf16 run's are read into fp32 per tensor (torch._foreach_norm's dtype; Megatron's
get_grad_norm_fp32 likewise), where the dense clip_grad_norm_ would sum in bf16 (8 bits of mantissa
over thousands of squares). The dense side validation compares against (`dense_norm`) is
clip_grad_norm_'s own arithmetic on fp32 copies where the gradients are bf16, itself where not.

Then every gradient is scaled by min(1, max_norm / (norm + 1e-6)), torch's clamped coefficient, in
place (`scale`): this rank's local gradients, or ZeRO-1's gradient pieces, the tensors its AdamW steps.
A non-finite norm (`finite`) is the caller's to act on: tpbench.experiments.training fails the run
or skips the step (train.grad_clip_nonfinite).

debug.clip_fault=double_count counts the replicated parameters on every TP rank (to prove validation
catches it); nonfinite writes inf into a gradient of every rank (`plant_nonfinite`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tpbench.parallel import collectives
from tpbench.parallel.plan import Layout
from tpbench.parallel.zero import ZeroModel

EPS = 1e-6  # clip_grad_norm_'s, added to the norm before the division


class NonFiniteGradNorm(RuntimeError):
    """The global gradient norm is inf or nan (train.grad_clip_nonfinite=error)."""


def global_norm(model, fault: str = "") -> torch.Tensor:
    """The global L2 norm of the model's gradients (after finish_grads), fp32, a 0-dim tensor on the
    gradients' device, the same on every rank. Collective over TP and the DP shard group."""
    pieces, groups = _counted(model, fault == "double_count")
    squares = _squares(pieces, _device(model))
    for group in groups:
        squares = collectives.all_reduce(squares, group, "grad_norm")
    return squares.sqrt()


def coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_'s clamped coefficient: min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (norm + EPS), max=1.0)


def scale(model, coef: torch.Tensor) -> None:
    """Every gradient the optimizer steps, times `coef` in place (torch._foreach_mul_, as clip_grad_norm_)."""
    grads = _stepped(model)
    if grads:
        with torch.no_grad():
            torch._foreach_mul_(grads, coef.to(grads[0].device))


def finite(norm: torch.Tensor) -> bool:
    """Whether the norm is finite: a host read (one sync a step on a GPU), except on an emulated rank's
    fake tensors, which hold no value (taken as finite)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(norm) or bool(torch.isfinite(norm).item())


def plant_nonfinite(model) -> None:
    """debug.clip_fault=nonfinite: every rank writes inf into the first element of the first gradient
    it counts in the norm (its ZeRO-1 shard's under ZeRO-1), as an overflow before the DP sum leaves it
    on every DP replica."""
    pieces, _ = _counted(model, False)
    with torch.no_grad():
        for p in pieces:  # the first non-empty one
            if p.numel():
                p.view(-1)[0] = float("inf")
                return


def dense_norm(params) -> torch.Tensor:
    """The dense model's global norm as validation's dense side clips it: clip_grad_norm_'s (foreach
    norms, then the norm of them), on fp32 copies of gradients in a lower precision, so that the
    dense side sums in fp32 as the sharded one does. fp32 and fp64 gradients: clip_grad_norm_ itself."""
    grads = [p.grad for p in params if p.grad is not None]
    up = [g.float() if g.dtype in (torch.bfloat16, torch.float16) else g for g in grads]
    return torch.nn.utils.get_total_norm(up, 2.0, foreach=True)


def dense_scale(params, coef: torch.Tensor) -> None:
    """The dense model's gradients times `coef` (clip_grad_norm_'s last op)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        with torch.no_grad():
            torch._foreach_mul_(grads, coef.to(grads[0].device))


# --- what this rank counts ----------------------------------------------------------------------


def counted_here(layout: Layout, tp: int, tp_rank: int) -> bool:
    """Whether this TP rank counts its part of a parameter of `layout` in the norm: every shard of
    a sharded one; a replicated one on rank 0; a KV head replicated over tp / num_shards ranks on the
    first of them."""
    if layout.dim is None:
        return tp_rank == 0
    return tp_rank % (tp // layout.num_shards) == 0


def _counted(model, double_count: bool) -> tuple[list[torch.Tensor], list[collectives.Group]]:
    """(this rank's gradient pieces counted in the norm, one per parameter, local tensors or views;
    the groups their squares are summed over: TP, then the DP shard group where DP shards the
    gradients). A piece this rank does not count is an empty view of its gradient: every rank makes
    as many norms, so that the step's memory is the same on every rank (tpbench.predict.theory)."""
    inner = getattr(model, "pm", model)  # ZeRO-1 and FSDP2 wrap a parallel model
    layouts: dict[str, Layout] | None = getattr(inner, "layouts", None)
    ctx = getattr(model, "ctx", None)
    tp, tp_rank = (ctx.tp, ctx.tp_rank) if ctx is not None else (1, 0)
    groups: list[collectives.Group] = [ctx.tp_group] if tp > 1 else []

    def counts(name: str) -> bool:
        return layouts is None or double_count or counted_here(layouts[name], tp, tp_rank)

    if isinstance(model, ZeroModel):
        opt = model.optimizer
        groups.append(opt.group)
        return _zero_pieces(opt, [counts(n) for n in opt.grad_views]), groups
    pieces, dp_groups = [], []
    for name, p in nn.Module.named_parameters(model.module):
        if p.grad is None:
            continue
        grad = p.grad
        if isinstance(grad, DTensor):
            dp_groups = dp_groups or _dp_shard_groups(grad)
            grad = grad.to_local()
        pieces.append(grad if counts(name) else grad.narrow(0, 0, 0))
    return pieces, groups + dp_groups


def _zero_pieces(opt, counts: list[bool]) -> list[torch.Tensor]:
    """Each parameter's part of ZeRO-1's gradient pieces (this rank's [B_b/DP] of each bucket), a
    view (empty where it has none in this rank's pieces, or where this rank does not count it)."""
    parts = opt.pieces_of(opt.grad_shards)
    return [p if counted else p[:0] for p, counted in zip(parts.values(), counts, strict=True)]


def _dp_shard_groups(grad: DTensor) -> list[dist.ProcessGroup]:
    """The groups of a DTensor gradient's mesh dims that shard it, TP's aside (FSDP2's dp or HSDP's
    dp_shard; a replicated dim, HSDP's dp_replicate, holds copies)."""
    names = grad.device_mesh.mesh_dim_names or ()
    return [
        grad.device_mesh.get_group(name)
        for name, placement in zip(names, grad.placements, strict=True)
        if name != "tp" and placement.is_shard()
    ]


def _squares(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every piece, in fp32: per-tensor norms (foreach, read in fp32), the
    norm of those, squared."""
    if not pieces:
        return torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        norms = torch._foreach_norm(pieces, 2, dtype=torch.float32)
        stacked = torch.stack(norms)
        del norms
        return torch.linalg.vector_norm(stacked).square()


def _stepped(model) -> list[torch.Tensor]:
    """The local gradients the optimizer steps: ZeRO-1's shard, else each parameter's (once)."""
    if isinstance(model, ZeroModel):
        return list(model.optimizer.grad_shards)
    grads = [p.grad for p in nn.Module.parameters(model.module) if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def _device(model) -> torch.device:
    return next(nn.Module.parameters(model.module)).device
