"""Validation of gradient clipping (train.grad_clip, tpbench.parallel.clip), at every AdamW step of
tpbench.experiments.validate:

- the dense side (`dense_side`): the dense model's global norm as clip_grad_norm_ computes it
  (clip.dense_norm) and its clamped coefficient; the reference's norm at the same weights (the copy
  the gradient check runs), whose difference from the dense norm is the norm's own rounding; the
  reference's own norm, which it clips by;
- the gradient check at the dense weights (`NormSteps.add`): the sharded model's global norm against
  the dense one, |sharded - dense| / dense <= k x |dense - reference| / reference + tol_grad_rel, the
  criterion's rule (tpbench.experiments.criterion), its worst step kept;
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

WHAT = "global gradient norm vs dense clip_grad_norm_'s, worst step"


@dataclass
class DenseSide:
    """The dense side's norms at one step, before any clipping."""

    norm: float  # the dense model's
    at_dense: float  # the reference's at the dense model's weights
    coef: torch.Tensor  # the dense model's clamped coefficient
    own_coef: torch.Tensor  # the reference's, from its own norm at its own weights


def dense_side(
    cfg: RunConfig, dense: nn.Module, reference: nn.Module, at_dense: nn.Module
) -> DenseSide | None:
    """The dense side's norms (None without train.grad_clip), after the three models' backward."""
    max_norm = cfg.train.grad_clip
    if max_norm <= 0:
        return None
    norm, at = clip.dense_norm(dense.parameters()), clip.dense_norm(at_dense.parameters())
    own = clip.dense_norm(reference.parameters())
    return DenseSide(
        norm.item(), at.item(), clip.coefficient(norm, max_norm), clip.coefficient(own, max_norm)
    )


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
        self.worst: Verdict | None = None

    def add(self, step: int, cfg: RunConfig, pm, side: DenseSide | None) -> None:
        """Step `step`'s figure: `pm`'s gradients at the dense weights, after the gradient sums
        (collective: every rank calls it, and gets the same norm)."""
        if side is None:
            return
        got = clip.global_norm(pm, cfg.debug.clip_fault).item()
        value = abs(got - side.norm) / max(side.norm, 1e-30)
        reference = abs(side.norm - side.at_dense) / max(side.at_dense, 1e-30)
        v = Verdict("grad_norm", WHAT, "", value, reference, cfg.validate.tol_grad_rel, cfg.validate.k, step)
        if self.worst is None or (v.of_bound, v.value) > (self.worst.of_bound, self.worst.value):
            self.worst = v

    def verdicts(self) -> list[Verdict]:
        """The worst step's verdict, its figures the worst over the ranks (none without clipping)."""
        if self.worst is None:
            return []
        v = self.worst
        v.value, v.reference = collectives.reduce_floats([v.value, v.reference], dist.ReduceOp.MAX)
        return [v]
