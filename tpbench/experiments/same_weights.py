"""Validation's gradient check at the same weights (tpbench.experiments.validate, issue 56 item 2):
at every step the sharded model and a copy of the reference take the dense model's current weights,
so each model's gradient is taken at one point and the difference is that step's rounding (or a
bug's), never the sum of every earlier step's drift.

The sharded model lends its own weights for the check and has them back after it (`dense_weights`):
its free-running AdamW steps (the seed's check, item 4) go on from where they were, nothing of the
dense model left in them. Each rank writes its part of the dense weights where its forward reads
them: a parameter's local tensor (the plan's modules, the DTensor engine's local shards, DDP's
replicas, ZeRO-1's param buffer, in the parameter's dtype), or under FSDP2 its DP shard of the TP
shard (DTensor redistribute: local, no collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tpbench.parallel.fsdp import FSDPModel


@contextlib.contextmanager
def dense_weights(pm, dense: nn.Module) -> Iterator[None]:
    """Inside: `pm` (any parallel model validate checks) holds this rank's part of `dense`'s weights
    (cast to its own dtype) and draws the dropout masks of the step it is at; on exit its own weights
    and dropout step are back, bit for bit."""
    slots = _forward_weights(pm)
    wanted = dict(dense.named_parameters())
    saved = {name: t.clone() for name, t in slots.items()}
    key = pm.module.model.dropout_key
    step = key.step
    with torch.no_grad():
        for name, t in slots.items():
            t.copy_(_local_part(pm, name, wanted[name].detach(), t))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, t in slots.items():
                t.copy_(saved[name])
        key.step = step


def load_reference(copy: nn.Module, dense: nn.Module) -> None:
    """`copy` (a copy of the reference, in its precision) takes the dense model's weights and its
    dropout step: the reference's gradient at the dense model's point."""
    with torch.no_grad():
        for p, want in zip(copy.parameters(), dense.parameters(), strict=True):
            p.copy_(want)
    copy.model.dropout_key.step = dense.model.dropout_key.step


def _forward_weights(pm) -> dict[str, torch.Tensor]:
    """name -> the tensor this rank's forward reads the weight from (written in place)."""
    if isinstance(pm, FSDPModel):
        for unit in pm.units:  # the sharded parameters are the ones the next forward gathers
            unit.reshard()
        return {n: p.to_local() for n, p in nn.Module.named_parameters(pm.module)}
    getattr(pm, "wait_params", lambda: None)()  # ZeRO-1: no all-gather still writing the weights
    return {n: p.detach() for n, p in pm.module.named_parameters()}


def _local_part(pm, name: str, dense: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """This rank's part of dense parameter `name`, shaped and typed as `local`."""
    mine = pm.shard_like(name, dense)  # the TP shard (the whole for DDP)
    if isinstance(pm, FSDPModel):
        own = dict(nn.Module.named_parameters(pm.module))[name]
        if isinstance(own, DTensor):
            tp_local = [p if n == "tp" else Replicate() for n, p in _named_placements(own)]
            whole = DTensor.from_local(mine.to(own.dtype), own.device_mesh, tp_local, run_check=False)
            mine = whole.redistribute(own.device_mesh, own.placements).to_local()
    return mine.to(local.dtype).view_as(local)


def _named_placements(t: DTensor) -> list[tuple[str, object]]:
    names = t.device_mesh.mesh_dim_names or ()
    return list(zip(names, t.placements, strict=True))
