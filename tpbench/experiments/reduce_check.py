"""Validation's check of the DP gradient reduction on identical inputs (issue 56, item 6): what the
gradient check cannot see, a reduction that rounds where the run promises it does not
(debug.low_precision_reduce: bf16 where mixed precision promises fp32, an error of 2^-9 relative
under bf16 compute's own 0.4-2.6%).

At each validation step, at the dense model's weights, the sharded model takes two more forward and
backward passes in which every DP rank is given the same micro-batches (DP rank 0's slice of the
step's batch, and rank 0's dropout masks: an input forced openly, for this check only):

    pass 1: every rank's loss as it is         each rank's local gradient g, the same on every rank
    pass 2: DP rank 0's loss x 2               rank 0's local gradient 2 g (x 2 is exact in floating
                                               point, through every op of backward), the others' g

so the DP-reduced gradients must be R1 = g and R2 = (DP + 1) / DP x g: R2 = (DP + 1) / DP x R1 up to
the rounding of the reduction alone, whatever the rounding of the forward and backward (the same on
every rank). In the reduction's promised dtype an average of DP values rounds each element at most
about DP times at its unit roundoff u (2^-24 in fp32); pass 1 of DP 2 is exact in any dtype, so a
reduction in bf16 of gradients that are bf16 already (autocast's weight gradients) shows only in pass
2, where 2 g + g needs up to two bits more than g. The figure, per parameter, is

    ||R2 - (DP + 1) / DP x R1|| / ||(DP + 1) / DP x R1||   <=   K x u + NOISE_K x noise

with u the unit roundoff of the promised reduction dtype (fp32 for fp32 and mixed runs, train.dtype
for pure bf16 or fp16) and K = 16: an fp32 reduction's worst at DP 4 is a few u, a bf16 one's about
2^-10 = 4,000 u. noise is 0 on a CPU, whose backward repeats to the bit; on CUDA, where a kernel may
add in any order (atomics), pass 1 runs twice and noise is ||R1' - R1|| / ||R1||, the backward's own
(not run on a GPU yet: a noise as large as bf16's rounding would leave the check blind there, never
failing a correct model). Each rank checks its own shard of every gradient (full_gradients), the worst over
the ranks kept. A bug that sums or averages the DP gradients wrongly by rank (a rank left out, its
own gradient kept: debug.shard_fault=no_reduce_scatter) fails it as well; one that scales every
rank's alike (a sum left undivided) passes it, and the gradient check sees that one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from tpbench.config import RunConfig
from tpbench.experiments.criterion import Verdict
from tpbench.models.dropout import PositionalDropout
from tpbench.models.minimind import DTYPES
from tpbench.parallel import collectives

K = 16.0  # the bound's multiple of the promised dtype's unit roundoff
NOISE_K = 4.0  # the bound's multiple of the backward's own noise (CUDA: pass 1 twice)
SCALE = 2.0  # DP rank 0's loss factor in pass 2: a power of 2, exact


def unit_roundoff(cfg: RunConfig) -> float:
    """u of the dtype the run promises to reduce the DP gradients in: fp32 for fp32 and mixed
    precision, train.dtype for pure bf16 or fp16."""
    promised = torch.float32 if cfg.train.precision == "mixed" else DTYPES[cfg.train.dtype]
    return torch.finfo(promised).eps / 2


def errors(pm, opt, run: Callable[[float], object], dp_rank: int, dp: int, repeat: bool) -> torch.Tensor:
    """[P, 2] per parameter of `pm` ||R2 - (DP + 1) / DP x R1|| / ||(DP + 1) / DP x R1|| and the
    backward's own noise, each the worst over all ranks (one all-reduce). run(scale): the step's
    forward and backward with every rank on DP rank 0's micro-batches, this rank's loss x scale
    (validate._accumulated); the passes start from the same dropout step, every rank drawing rank 0's
    masks, at the weights `pm` holds. repeat (CUDA, whose kernels may add in any order: atomics in
    attention's backward): pass 1 again, ||R1' - R1|| / ||R1|| the noise (NOISE_K of it is added to
    the bound); else 0 (a CPU's backward repeats to the bit)."""
    key = pm.module.model.dropout_key
    start = key.step

    def grads_after(scale: float) -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        key.step = start
        with rank0_masks(pm.module):
            run(scale)
        return {n: g.detach().clone() for n, g in pm.full_gradients().items()}

    first = grads_after(1.0)
    again = grads_after(1.0) if repeat else first
    second = grads_after(SCALE if dp_rank == 0 else 1.0)
    ratio = (dp + SCALE - 1) / dp
    figures = [[_rel(second[n], r1, ratio), _rel(again[n], r1, 1.0)] for n, r1 in first.items()]
    return collectives.reduce_over_world(torch.tensor(figures, dtype=torch.float64), dist.ReduceOp.MAX).cpu()


def _rel(got: torch.Tensor, base: torch.Tensor, ratio: float) -> float:
    """||got - ratio x base|| / ||ratio x base||, in fp64 (0 for an empty shard)."""
    if not got.numel():
        return 0.0
    want = base.double() * ratio
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


@contextlib.contextmanager
def rank0_masks(module: nn.Module) -> Iterator[None]:
    """Inside: every dropout of `module` draws DP rank 0's part of the batch's masks, as every rank
    takes rank 0's micro-batches; its own part back on exit."""
    dropouts = [m for m in module.modules() if isinstance(m, PositionalDropout)]
    saved = [dict(m.splits) for m in dropouts]
    for m in dropouts:
        if "batch" in m.splits:
            m.splits["batch"] = (0, m.splits["batch"][1])
    try:
        yield
    finally:
        for m, splits in zip(dropouts, saved, strict=True):
            m.splits = splits


WHAT = "DP reduction on identical inputs: rel. error, worst step"


class WorstSteps:
    """Per parameter, the step whose reduction figure came nearest its bound (K x u + NOISE_K x that
    step's noise)."""

    def __init__(self, cfg: RunConfig, names: list[str]) -> None:
        self.u, self.names = unit_roundoff(cfg), names
        self.worst: list[tuple[float, float, int]] = []  # (figure, noise, step) per parameter

    def add(self, step: int, figures: torch.Tensor) -> None:
        rows = [(value, noise, step) for value, noise in figures.tolist()]
        if not self.worst:
            self.worst = rows
            return
        self.worst = [max(old, new, key=self._of_bound) for old, new in zip(self.worst, rows, strict=True)]

    def _of_bound(self, row: tuple[float, float, int]) -> float:
        return row[0] / (K * self.u + NOISE_K * row[1])

    def verdicts(self) -> list[Verdict]:
        """dp_reduce's verdict on every parameter: K x the promised dtype's unit roundoff + NOISE_K x
        the backward's own noise (0 on a CPU)."""
        return [
            Verdict("dp_reduce", WHAT, n, value, self.u, NOISE_K * noise, K, step)
            for n, (value, noise, step) in zip(self.names, self.worst, strict=True)
        ]
