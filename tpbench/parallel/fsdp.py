"""ZeRO-2 and ZeRO-3 with torch's FSDP2 (`parallel.dp_shard=grads|full`), over the DP group of each
TP rank, as torchtitan composes FSDP2 with TP.

`fully_shard` once per decoder block and once for the root (the embedding, final norm, LM head),
over the DP mesh: each parameter becomes a DTensor whose local tensor is 1/DP of its TP shard
(dim 0, padded by FSDP2 to a multiple of DP). Before a block's forward its weights are all-gathered
([TP shard / DP] -> [TP shard]), after its backward its gradients reduce-scattered and averaged
([TP shard] -> [TP shard / DP]); the optimizer steps the sharded parameters, its moments sharded
with them. `reshard_after_forward`: False for grads (ZeRO-2, FSDP1's SHARD_GRAD_OP: the gathered
weights are kept from forward through backward), True for full (ZeRO-3: gathered again for
backward). Mixed precision is FSDP2's `MixedPrecisionPolicy`: bf16 gathered weights, fp32 sharded
masters and fp32 gradient reduction.

What tpbench adds: the gathers and reduce-scatters go through tpbench.parallel.collectives (FSDP2's
custom comm hooks), so they are counted (`dp_params`, `dp_grads`) and a fault can break them; the TP
gradient sums (q/k norms, SP norms, KV replicas) run on the sharded gradients' local tensors after
FSDP2's reduce-scatter (a sum over TP ranks commutes with an average over DP ranks, and every TP
rank of a DP group shards its replicated weight alike).

HSDP (`parallel.dp_replicate=R`): FSDP2's 2-D mesh (replicate, shard): each parameter is sharded over
dp / R consecutive DP ranks (within a node) and replicated across the R groups; the gradients are
reduce-scattered within a group, then all-reduced across the groups (FSDP2 issues that all-reduce
itself, outside the custom comms: its all-reduce hook, which runs right after it, counts it).

The DP mesh is the layout's (tpbench.parallel.context): its dp dim, or under HSDP its (dp_replicate,
dp_shard) dims, made once per job. With the DTensor engine its tp dim holds the TP shards, so FSDP2
composes both into one mesh, (dp, tp) or (dp_replicate, dp_shard, tp), HSDP's included.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor, Replicate

from tpbench.config import ParallelConfig, TrainConfig
from tpbench.models.minimind import DTYPES
from tpbench.parallel import collectives, instrumentation


class _Work:
    """What FSDP2 waits on: our Pending."""

    def __init__(self, pending: collectives.Pending):
        self.pending = pending

    def wait(self) -> bool:
        self.pending.wait()
        return True


class CountedAllGather(AllGather):
    """FSDP2's all-gather of a unit's weight shards, through tpbench's collectives (`dp_params`).
    fault no_all_gather: only this rank's shard arrives, the others' are zeros."""

    def __init__(self, fault: str = ""):
        self.fault = fault

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if self.fault == "no_all_gather":
            output_tensor.zero_()
            n = input_tensor.numel()
            output_tensor.narrow(0, dist.get_rank(group) * n, n).copy_(input_tensor)
            return None

        def fn(x: torch.Tensor, out: torch.Tensor) -> dist.Work:
            return collectives.all_gather_single(out, x, group, async_op=True)

        pending = collectives.launch_counted(
            "all_gather", input_tensor, output_tensor, group, "dp_params", fn
        )
        if async_op:
            return _Work(pending)
        pending.wait()
        return None


class CountedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of a unit's gradients, through tpbench's collectives (`dp_grads`).
    fault no_reduce_scatter: this rank keeps its own chunk, never summed."""

    def __init__(self, fault: str = ""):
        self.fault = fault

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if self.fault == "no_reduce_scatter":
            n = output_tensor.numel()
            output_tensor.copy_(input_tensor.narrow(0, dist.get_rank(group) * n, n))
            return None

        def fn(x: torch.Tensor, out: torch.Tensor) -> dist.Work:
            return collectives.reduce_scatter_single(out, x, op=op, group=group, async_op=True)

        pending = collectives.launch_counted(
            "reduce_scatter", input_tensor, output_tensor, group, "dp_grads", fn
        )
        if async_op:
            return _Work(pending)
        pending.wait()
        return None


class FSDPModel:
    """A parallel model (any TP mode of either engine, or the dense model at tp 1) with FSDP2 over
    its DP dimension: the model's interface for training and the checks."""

    def __init__(
        self,
        pm,
        pcfg: ParallelConfig,
        train: TrainConfig,
        fault: str = "",
        low_precision_reduce: bool = False,
    ):
        self.pm, self.module, self.ctx = pm, pm.module, pm.ctx
        if pcfg.engine == "dtensor":  # its DP average is FSDP2's now
            pm.skip_grad_sum = (*pm.skip_grad_sum, "dp")
        else:
            pm.grad_sums = [gs for gs in pm.grad_sums if gs.name != "dp"]
        # the DP dims of the layout's mesh, whose tp dim holds the DTensor engine's TP shards: FSDP2
        # composes them into one (dp, tp) or (dp_replicate, dp_shard, tp) mesh
        mesh = pm.ctx.with_replicas(pcfg.dp_replicate).fsdp_mesh
        mixed = train.precision == "mixed"
        # low_precision_reduce (debug.low_precision_reduce, to prove validation catches it): no
        # reduce_dtype, so FSDP2 reduces the gradients in param_dtype, the compute dtype
        reduce = None if low_precision_reduce else torch.float32
        policy = (
            MixedPrecisionPolicy(param_dtype=DTYPES[train.dtype], reduce_dtype=reduce)
            if mixed
            else MixedPrecisionPolicy()
        )
        reshard = pcfg.dp_shard == "full"
        self.units = [*self.module.model.layers, self.module]
        for unit in self.units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        for unit in self.units:
            unit.set_custom_all_gather(CountedAllGather(fault))
            unit.set_custom_reduce_scatter(CountedReduceScatter(fault))
            if pcfg.dp_replicate > 1:
                unit.set_all_reduce_hook(_count_replicated_all_reduce(pcfg.dp_replicate))

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.pm(input_ids, labels)

    def set_gradient_sync(self, on: bool) -> None:
        """train.accumulation: FSDP2 syncs every micro-batch whatever `on` says (torchtitan's choice,
        and FSDP2's default): each unit's gradients are reduce-scattered (and all-reduced between
        HSDP's replicas) in every backward, so they stay sharded, each micro-batch's shard added into
        the sharded `.grad`. Turning the sync off (set_requires_gradient_sync(False)) would hold every
        unit's gradients unsharded, in the reduce dtype, from the first backward to the last."""
        self.module.set_requires_gradient_sync(True)

    def finish_grads(self) -> None:
        """The TP gradient sums, on the local tensors of FSDP2's sharded (averaged) gradients; the
        DTensor engine's as its model makes them (Partial gradients redistributed)."""
        if not hasattr(self.pm, "grad_sums"):
            self.pm.finish_grads()
            return
        params = dict(self.module.named_parameters())
        for gs in self.pm.grad_sums:
            grads = [_local(params[n].grad) for n in gs.params if params[n].grad is not None]
            collectives.all_reduce_coalesced(grads, gs.group, "grad_sum", gs.average)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Each parameter's gradient with its DP shards gathered (for checks only, not counted)."""
        return {n: _full(p.grad) for n, p in nn.Module.named_parameters(self.module)}

    def write_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        """Gradients shaped as full_gradients gives them: each rank's DP shard of them written into
        its sharded gradient (validate's sign rule only; Replicate -> Shard is local, no collective)."""
        params = dict(nn.Module.named_parameters(self.module))
        with torch.no_grad():
            for name, grad in grads.items():
                own = params[name].grad
                if not isinstance(own, DTensor):
                    own.copy_(grad)
                    continue
                mine = DTensor.from_local(grad, own.device_mesh, _tp_local(own), run_check=False)
                own.to_local().copy_(mine.redistribute(own.device_mesh, own.placements).to_local())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Each parameter's sharded master gathered (the units resharded first: grads leaves the
        gathered weights in place after a forward)."""
        for unit in self.units:
            unit.reshard()
        return {n: _full(p.detach()) for n, p in nn.Module.named_parameters(self.module)}

    def semantics(self, name: str) -> str:
        return self.pm.semantics(name)

    def shard_like(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        return self.pm.shard_like(name, dense)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.pm.full_logits(logits)


def _count_replicated_all_reduce(replicas: int):
    """HSDP's all-reduce of a unit's reduce-scattered gradients across the replicas, which FSDP2 has
    just issued on its own: counted (`dp_grads`), not timed."""

    def count(reduced: torch.Tensor) -> None:
        counter = instrumentation.active_counter()
        if counter is not None:
            purpose = instrumentation.counted_purpose("dp_grads")
            counter.record("all_reduce", purpose, reduced.numel() * reduced.element_size(), replicas, 0.0)

    return count


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The TP-local whole of a DP-sharded DTensor (a DTensor engine's TP shard stays its local part)."""
    if not isinstance(t, DTensor):
        return t
    return t.redistribute(t.device_mesh, _tp_local(t)).to_local()


def _tp_local(t: DTensor) -> list:
    """t's placements with every mesh dimension but TP replicated: its TP-local whole's."""
    names = t.device_mesh.mesh_dim_names or ()
    return [p if name == "tp" else Replicate() for name, p in zip(names, t.placements, strict=True)]
