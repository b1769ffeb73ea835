"""Validation of gradient clipping (train.grad_clip, tpbench.parallel.clip), at every AdamW step of
tpbench.experiments.validate:

- the dense side (`dense_side`): the dense model's global norm as clip_grad_norm_ computes it
  (clip.dense_norm) and its clamped coefficient; that norm's own rounding (against the fp64 norm of
  the same gradients); the reference's own norm, which it clips by;
- the gradient check at the dense weights (`NormSteps.add`), two verdicts:
  `grad_norm`, the sharded model's global norm (clip.global_norm: which shards each rank counts, its
  collectives) against the fp64 norm of the very gradients the gradient check compares, each
  element counted once (`own_norm`: a parameter's squares summed over every rank and divided by how
  many ranks hold each element, read from the numels, not from the clip's own bookkeeping), bound
  k x the dense norm's own rounding + tol_grad_rel: a double count or a missing shard fails it in
  every precision;
  `grad_norm_dense`, the sharded norm against the dense clip_grad_norm_'s, bound 1 x the distance of
  the two gradients, ||g_sharded - g_dense|| / ||g_dense|| (measured the same way, each element once)
  + tol_grad_rel: no norm of two vectors differs by more than the vectors do (the triangle
  inequality). Two norms are not compared by the dense norm's rounding: the sharded gradients differ
  from the dense ones by their own rounding (a bf16 gradient within the gradient check's bound,
  ~1e-2 relative), and the norm moves by about the square of that, which the dense side's rounding
  (~1e-5) does not cover (a TP 2 SP VP DP 2 mixed run was failed so, correct);
- the optimizer on identical inputs (tpbench.experiments.optimizer_check): both sides scale the dense
  gradient by the dense coefficient before AdamW, the sharded side with its own clip.scale;
- the free-running steps clip on every side (`clip_sharded`, `clip_dense`).

The norm is checked apart from the coefficient on purpose: summed in another order, the sharded
norm differs from the dense one by rounding, so a coefficient taken from it would move the optimizer
check's updates off the dense ones by rounding too, where they are compared to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tpbench.config import RunConfig
from tpbench.experiments.criterion import Verdict
from tpbench.parallel import clip, collectives

WHAT = "global gradient norm vs its own gradients' (each element once), worst step"
WHAT_DENSE = "global gradient norm vs dense clip_grad_norm_'s (bound: the gradients' distance), worst step"


@dataclass
class DenseSide:
    """The dense side's norms at one step, before any clipping."""

    norm: float  # the dense model's
    rounding: float  # |that - the fp64 norm of the same gradients| / the fp64 norm
    coef: torch.Tensor  # the dense model's clamped coefficient
    own_coef: torch.Tensor  # the reference's, from its own norm at its own weights


def dense_side(cfg: RunConfig, dense: nn.Module, reference: nn.Module) -> DenseSide | None:
    """The dense side's norms (None without train.grad_clip), after the three models' backward."""
    max_norm = cfg.train.grad_clip
    if max_norm <= 0:
        return None
    norm, own = clip.dense_norm(dense.parameters()), clip.dense_norm(reference.parameters())
    exact = _fp64_norm([p.grad for p in dense.parameters() if p.grad is not None])
    rounding = abs(norm.item() - exact) / max(exact, 1e-30)
    return DenseSide(norm.item(), rounding, clip.coefficient(norm, max_norm), clip.coefficient(own, max_norm))


def _fp64_norm(grads: list[torch.Tensor]) -> float:
    return float(torch.stack([g.detach().double().norm() for g in grads]).norm()) if grads else 0.0


def own_norm(pm, dense: nn.Module) -> tuple[float, float]:
    """The fp64 norms of `pm`'s gradients (full_gradients: what the gradient check compares) and of
    their difference from the dense model's, each element counted once over the world: per parameter
    the squares summed over every rank, divided by how many ranks hold each of its elements (the
    numels summed over the world / the dense parameter's numel: T x DP for a norm's weight, DP for a
    TP shard, T / N_kv x DP for a replicated KV head). Collective: one all-reduce."""
    dense_params = dict(dense.named_parameters())
    table = []
    for name, grad in pm.full_gradients().items():
        g = grad.detach().double()
        want = pm.shard_like(name, dense_params[name].grad).double()
        table.append([g.pow(2).sum(), (g - want).pow(2).sum(), g.numel(), dense_params[name].numel()])
    t = torch.tensor([[float(x) for x in row] for row in table], dtype=torch.float64)
    summed = collectives.reduce_over_world(t[:, :3].contiguous(), dist.ReduceOp.SUM).cpu()
    holders = summed[:, 2] / t[:, 3]  # [P] ranks holding each element
    norm, dist_sq = (summed[:, 0] / holders).sum().sqrt(), (summed[:, 1] / holders).sum().sqrt()
    return float(norm), float(dist_sq)


def clip_dense(side: DenseSide | None, dense: nn.Module, reference: nn.Module) -> None:
    """The dense model and the reference clipped before their AdamW steps, each by its own norm."""
    if side is not None:
        clip.dense_scale(dense.parameters(), side.coef)
        clip.dense_scale(reference.parameters(), side.own_coef)


def clip_sharded(cfg: RunConfig, pm) -> None:
    """The sharded model's free-running step clipped as a training step clips (its own norm); a
    non-finite norm fails the run."""
    if cfg.train.grad_clip <= 0:
        return
    norm = clip.global_norm(pm, cfg.debug.clip_fault)
    if not clip.finite(norm):
        raise clip.NonFiniteGradNorm(
            f"train.grad_clip: the sharded model's global gradient norm is {norm.item()}"
        )
    clip.scale(pm, clip.coefficient(norm, cfg.train.grad_clip))


def count_norm(cfg: RunConfig, pm) -> None:
    """The norm's collectives in the counted first step (under `counting`), as a training step issues them."""
    if cfg.train.grad_clip > 0:
        clip.global_norm(pm, cfg.debug.clip_fault)


class NormSteps:
    """The sharded global norm against the dense one at every step; the worst step's verdict."""

    def __init__(self) -> None:
        self.worst: dict[str, Verdict] = {}

    def add(self, step: int, cfg: RunConfig, pm, dense: nn.Module, side: DenseSide | None) -> None:
        """Step `step`'s figures: `pm`'s gradients at the dense weights, after the gradient sums
        (collective: every rank calls it, and gets the same norms)."""
        if side is None:
            return
        got = clip.global_norm(pm, cfg.debug.clip_fault).item()
        own, distance = own_norm(pm, dense)
        floor, k = cfg.validate.tol_grad_rel, cfg.validate.k
        off_own, off_dense = abs(got - own) / max(own, 1e-30), abs(got - side.norm) / max(side.norm, 1e-30)
        for v in (
            Verdict("grad_norm", WHAT, "", off_own, side.rounding, floor, k, step),
            Verdict(
                "grad_norm_dense",
                WHAT_DENSE,
                "",
                off_dense,
                distance / max(side.norm, 1e-30),
                floor,
                1.0,
                step,
            ),
        ):
            worst = self.worst.get(v.check)
            if worst is None or (v.of_bound, v.value) > (worst.of_bound, worst.value):
                self.worst[v.check] = v

    def verdicts(self) -> list[Verdict]:
        """Each check's worst step, its figures the worst over the ranks (none without clipping)."""
        for v in self.worst.values():
            v.value, v.reference = collectives.reduce_floats([v.value, v.reference], dist.ReduceOp.MAX)
        return list(self.worst.values())
