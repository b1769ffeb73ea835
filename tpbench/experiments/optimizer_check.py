"""The sharded optimizer on identical inputs (issue 56, item 3): each DP level's and TP mode's AdamW,
given the dense model's weights, AdamW state and gradients (each rank its shards of them), must make
the dense optimizer's update.

What each level steps, and how its shards are written here:
- plain tensors (our engine's TP shards, DDP's replica, the dense model at tp 1): each parameter's
  TP shard (`shard_like`), its moments and gradient beside it, AdamW per tensor, foreach or fused as
  the run's optimizer is built (tpbench.experiments.training.adamw);
- DTensors (the DTensor engine's TP shards, FSDP2's DP shards of them, HSDP's 2-D mesh): the same
  TP-local whole redistributed to the parameter's placements (Replicate -> Shard is local);
- ZeRO-1's buckets (tpbench.parallel.zero): every parameter flattened into [P] as its buckets lay
  them out, this rank's piece of each bucket as the master pieces, their moments and gradient pieces,
  then the optimizer's own step (AdamW on the pieces, then the buckets' all-gathers of the weights).

`updates` steps the sharded optimizer once on those inputs, reads the stepped weights back as the
checks read them (full_parameters: TP-local wholes), and compares each parameter's update with the
dense optimizer's on the same inputs (a copy of it: the dense model and its optimizer are not
touched). Everything the sharded step wrote is put back afterwards (weights, gradients, state): a
run goes on as if unchecked. AdamW is elementwise, so a level that steps the same kernel on the same
elements gives the dense update to the bit (docs/results/sharded_dp.md says which do); the figure
beside it is the dense update's own rounding, against a reference AdamW one precision up.
With train.grad_clip both sides step the dense gradient scaled by the dense model's clip coefficient
(`coef`): the dense side by torch's foreach multiply, the sharded one by its own clip.scale on its
shards (ZeRO-1's pieces included), so the clip's scaling is in the update compared to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tpbench.experiments.criterion import Verdict
from tpbench.parallel import clip, collectives
from tpbench.parallel.fsdp import _tp_local
from tpbench.parallel.zero import DistributedOptimizer

MOMENTS = ("exp_avg", "exp_avg_sq")
HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused")


@dataclass
class UpdateRow:
    """One parameter's figures, each the worst over the ranks (each rank compares its own shard)."""

    name: str
    max_abs: float  # max |sharded update - dense update|
    rel_l2: float  # ||sharded update - dense update|| / ||dense update||
    ref_rel_l2: float  # ||dense update - reference update|| / ||reference update||: its own rounding
    moved: float  # ||dense update||: the step the check compares (never 0 where it means anything)
    # ZeRO-1: max |the all-gathered weights the next forward takes - its own stepped masters in the
    # weights' dtype| (a broken all-gather shows here, not in the masters: bitwise, fused or not); 0 for
    # the levels with no gather after the step
    gathered_max_abs: float = 0.0


def updates(
    pm,
    opt,
    dense: nn.Module,
    dense_opt: torch.optim.Optimizer,
    reference_dtype: torch.dtype = torch.float64,
    coef: torch.Tensor | None = None,
) -> list[UpdateRow]:
    """The sharded optimizer `opt` of the parallel model `pm` (a torch optimizer over pm.module's
    parameters, or ZeroModel's DistributedOptimizer) stepped once from the dense model's weights, AdamW
    state (`dense_opt`'s: zeros at step 0 where it has not stepped) and gradients, against the dense
    optimizer's update on the same inputs; the reference AdamW (plain, in `reference_dtype`) gives the
    dense update's own rounding. Collective over the whole job (every rank calls it); every rank gets
    the same rows, in pm.full_parameters()'s order."""
    params = dict(dense.named_parameters())
    weights = {n: p.detach() for n, p in params.items()}
    grads = {n: p.grad.detach() for n, p in params.items()}
    raw, grads = grads, _clipped(grads, coef)  # the dense side steps the clipped gradients
    states = {n: _dense_state(dense_opt, p) for n, p in params.items()}
    # each parameter's group's: its weight decay (train.no_decay) and the lr its schedule is at now
    group = {id(p): g for g in dense_opt.param_groups for p in g["params"]}
    hyper = {n: {k: v for k, v in group[id(p)].items() if k in HYPER} for n, p in params.items()}
    want = _stepped(weights, grads, states, hyper, None)
    plain = {n: {**h, "foreach": False, "fused": None} for n, h in hyper.items()}
    exact = _stepped(weights, grads, states, plain, reference_dtype)
    gathered: dict[str, torch.Tensor] = {}
    if isinstance(opt, DistributedOptimizer):
        got, gathered = _zero_step(pm, opt, weights, raw, states, coef)
    else:
        got = _torch_step(pm, opt, weights, raw, states, coef)
    figures = []
    for name, stepped in got.items():
        start, dense_w, ref_w = (pm.shard_like(name, t[name]).double() for t in (weights, want, exact))
        late = 0.0
        if name in gathered:
            cast = stepped.to(gathered[name].dtype).double()  # its own masters, fused or not
            late = (gathered[name].double() - cast).abs().max().item() if cast.numel() else 0.0
        diff = stepped.double() - dense_w
        moved, ref_moved = dense_w - start, ref_w - start
        figures.append(
            [
                diff.abs().max().item() if diff.numel() else 0.0,
                (diff.norm() / moved.norm().clamp(min=1e-30)).item(),
                ((dense_w - ref_w).norm() / ref_moved.norm().clamp(min=1e-30)).item(),
                moved.norm().item(),
                late,
            ]
        )
    worst = collectives.reduce_over_world(torch.tensor(figures, dtype=torch.float64), dist.ReduceOp.MAX)
    return [UpdateRow(name, *row) for name, row in zip(got, worst.tolist(), strict=True)]


def _dense_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The dense AdamW's state of `p` (step, moments), copied; a parameter it never stepped: step 0,
    zero moments, as AdamW starts."""
    state = opt.state.get(p) or {}
    if not state:
        return {"step": torch.tensor(0.0), **{k: torch.zeros_like(p.detach()) for k in MOMENTS}}
    return {"step": state["step"].detach().clone(), **{k: state[k].detach().clone() for k in MOMENTS}}


def _stepped(weights, grads, states, hyper: dict, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """One step of AdamW on copies of the dense inputs (in `dtype`, or their own), each parameter in a
    group of its own hyperparameters (hyper[name]): the weights after it."""
    # copies always: w.to(dtype) is w itself where the dtypes agree (the fp32 reference of a mixed run's
    # fp32 dense weights), and this step would write into the dense model
    copies = {n: nn.Parameter(w.to(dtype or w.dtype, copy=True)) for n, w in weights.items()}
    adamw = torch.optim.AdamW([{"params": [p], **hyper[n]} for n, p in copies.items()])
    for n, p in copies.items():
        p.grad = grads[n].to(p.dtype, copy=True)  # copies: AdamW steps its moments in place
        adamw.state[p] = {
            "step": states[n]["step"].clone(),
            **{k: states[n][k].to(p.dtype, copy=True) for k in MOMENTS},
        }
    adamw.step()
    return {n: p.detach() for n, p in copies.items()}


def _clipped(grads: dict[str, torch.Tensor], coef: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """train.grad_clip: the dense gradients times the dense clip coefficient, as clip_grad_norm_
    scales them (a foreach multiply); None: the gradients themselves."""
    if coef is None:
        return grads
    return dict(zip(grads, torch._foreach_mul(list(grads.values()), coef), strict=True))


def _zero_step(pm, zopt: DistributedOptimizer, weights, grads, states, coef=None) -> tuple[dict, dict]:
    """ZeRO-1: the master pieces, their moments and gradient pieces from the dense inputs, the
    optimizer's own step (AdamW, then the buckets' all-gathers, waited here): the stepped masters
    (gathered for the check) and the weights the all-gathers left in the parameter buffer; then put
    back."""

    def shard(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return zopt.shard_of({n: pm.shard_like(n, tensors[n]) for n in zopt.params})

    zopt.wait_params()
    masters = zopt.masters
    saved = [m.detach().clone() for m in masters], zopt.param_buffer.clone()
    saved_grads = [g.clone() for g in zopt.grad_shards]
    saved_state = [_copy_state(zopt.adamw.state.get(m)) for m in masters]
    step = next(iter(states.values()))["step"]
    moments = {k: shard({n: s[k] for n, s in states.items()}) for k in MOMENTS}
    with torch.no_grad():
        for i, (m, w, g) in enumerate(zip(masters, shard(weights), shard(grads), strict=True)):
            m.copy_(w)
            zopt.grad_shards[i].copy_(g)
            zopt.adamw.state[m] = {"step": step.clone(), **{k: moments[k][i] for k in MOMENTS}}
    if coef is not None:  # train.grad_clip: its own scaling of its pieces, by the dense coefficient
        clip.scale(pm, coef)
    zopt.step()
    zopt.wait_params()
    stepped = {n: t.clone() for n, t in zopt.full_masters().items()}
    gathered = {n: view.clone() for n, view in zopt.param_views.items()}
    with torch.no_grad():
        for m, w, g, grad in zip(masters, saved[0], zopt.grad_shards, saved_grads, strict=True):
            m.copy_(w)
            g.copy_(grad)
        zopt.param_buffer.copy_(saved[1])
    for m, state in zip(masters, saved_state, strict=True):
        _put_state(zopt.adamw, m, state)
    return stepped, gathered


def _torch_step(pm, opt: torch.optim.Optimizer, weights, grads, states, coef=None) -> dict[str, torch.Tensor]:
    """A torch optimizer over pm.module's parameters (plain tensors or DTensors): each parameter, its
    gradient and moments written as its shards of the dense ones, one step, the stepped weights read
    as TP-local wholes (full_parameters); then put back."""
    for unit in getattr(pm, "units", []):  # FSDP2: the sharded parameters are what the optimizer steps
        unit.reshard()
    params = dict(nn.Module.named_parameters(pm.module))
    saved = {
        n: (_local(p).detach().clone(), p.grad, _copy_state(opt.state.get(p))) for n, p in params.items()
    }
    with torch.no_grad():
        for n, p in params.items():
            _local(p).copy_(_local(_like(p, pm.shard_like(n, weights[n]))))
            p.grad = _like(p, pm.shard_like(n, grads[n]))
            moments = {k: _like(p, pm.shard_like(n, states[n][k])) for k in MOMENTS}
            opt.state[p] = {"step": states[n]["step"].clone(), **moments}
    if coef is not None:  # train.grad_clip: its own scaling of its gradients, by the dense coefficient
        clip.scale(pm, coef)
    opt.step()
    stepped = {n: t.clone() for n, t in pm.full_parameters().items()}
    with torch.no_grad():
        for n, p in params.items():
            local, grad, state = saved[n]
            _local(p).copy_(local)
            p.grad = grad
            _put_state(opt, p, state)
    return stepped


def _like(p: torch.Tensor, tp_local: torch.Tensor) -> torch.Tensor:
    """`tp_local` (this rank's TP-local whole of a tensor shaped as `p`) in p's dtype, as `p` holds it:
    a DTensor redistributed to p's placements (its DP shard: local, no collective)."""
    value = tp_local.detach().to(p.dtype)
    if not isinstance(p, DTensor):
        return value.clone()
    mine = DTensor.from_local(value, p.device_mesh, _tp_local(p), run_check=False)
    return mine.redistribute(p.device_mesh, p.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _copy_state(state: dict | None) -> dict | None:
    if not state:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _put_state(opt: torch.optim.Optimizer, p: torch.Tensor, state: dict | None) -> None:
    if state is None:
        opt.state.pop(p, None)
    else:
        opt.state[p] = state


class WorstSteps:
    """Validation's optimizer check at every step (tpbench.experiments.validate): per parameter the
    step whose update was farthest from the dense one (relative L2, beside the dense update's own
    rounding at that step), and the largest gathered-weights difference (ZeRO-1)."""

    def __init__(self, fused: bool, zero1: bool):
        self.fused, self.zero1 = fused, zero1
        self.rows: dict[str, list[float]] = {}  # name -> [rel_l2, ref_rel_l2, step, gathered, its step]

    def add(self, step: int, rows: list[UpdateRow]) -> None:
        for r in rows:
            worst = self.rows.setdefault(r.name, [r.rel_l2, r.ref_rel_l2, step, r.gathered_max_abs, step])
            if r.rel_l2 > worst[0]:
                worst[:3] = [r.rel_l2, r.ref_rel_l2, step]
            if r.gathered_max_abs > worst[3]:
                worst[3:] = [r.gathered_max_abs, step]

    def verdicts(self, k: float) -> list[Verdict]:
        """Per check its worst parameter: optimizer_update (bitwise, bound 0, but under fused AdamW:
        another kernel, within k x the dense update's own rounding) and under ZeRO-1
        optimizer_gather (bitwise)."""
        update = [
            Verdict("optimizer_update", UPDATE, n, rel, ref, 0.0, k if self.fused else 0.0, int(step))
            for n, (rel, ref, step, *_) in self.rows.items()
        ]
        out = [max(update, key=_badness)]
        if self.zero1:
            gather = [Verdict("optimizer_gather", GATHER, n, g, 0.0, 0.0, 0.0, int(step))
                      for n, (*_, g, step) in self.rows.items()]  # fmt: skip
            out.append(max(gather, key=_badness))
        return out


UPDATE = "AdamW on identical inputs: update vs dense's, worst step"
GATHER = "ZeRO-1's gathered weights vs its masters, worst step"


def _badness(v: Verdict) -> tuple[float, float]:
    """Orders a check's verdicts: past its bound first (a bound of 0 gives inf), then the value."""
    return v.of_bound, v.value


def is_fused(opt) -> bool:
    """Whether the run's optimizer (AdamW, or ZeRO-1's over its shard) steps the fused kernel."""
    return any(bool(g.get("fused")) for g in getattr(opt, "adamw", opt).param_groups)
