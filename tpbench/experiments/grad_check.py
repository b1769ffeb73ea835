"""Validation's gradient figures at one step (tpbench.experiments.validate, issue 56 items 2 and 5),
and per parameter the worst step's.

At each step every parameter's gradient on this rank, taken at the dense model's weights
(tpbench.experiments.same_weights), is compared with its shard of the dense model's gradient, and
that with the reference's at the same weights: the relative L2 of the whole parameter, and of its
worst row. A row is a head's slice of q/k/v (its head_dim output rows) or of o (its head_dim input
columns), a vocabulary row of the embedding and the LM head, an output row of any other matrix; a
vector (a norm's weight) has none. A row's error is relative to its own dense gradient's norm (a row
whose dense gradient is 0, a token no batch held, to the parameter's rms row norm); the row figure
is the largest over the rows, for the sharded model and for the reference alike. The whole
parameter's relative L2 dilutes one wrong row among R by about sqrt(R); the worst row does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tpbench.parallel import collectives

# per parameter: mean |diff|, max |diff|, relative L2, the reference's relative L2, and the worst
# row's of both (NO_ROWS: a vector)
COLUMNS = ("grad_mean_abs", "grad_max_abs", "grad_rel_l2", "grad_ref_rel_l2", "row", "row_ref")
NO_ROWS = -1.0


def step_errors(pm, dense: nn.Module, reference: nn.Module, head_dim: int) -> torch.Tensor:
    """[P, 6] COLUMNS per parameter of `pm`, each the worst over all ranks (one all-reduce)."""
    dense_params, ref_params = dict(dense.named_parameters()), dict(reference.named_parameters())
    stats = []
    for name, grad in pm.full_gradients().items():
        g = grad.detach().double()
        want = pm.shard_like(name, dense_params[name].grad).double()
        exact = pm.shard_like(name, ref_params[name].grad).double()
        diff = (g - want).abs()
        rows = _row_errors(name, g, want, exact, head_dim)
        stats.append([diff.mean(), diff.max(), _rel_l2(g, want, want), _rel_l2(want, exact, exact), *rows])
    table = torch.tensor([[float(x) for x in row] for row in stats], dtype=torch.float64)
    return collectives.reduce_over_world(table, dist.ReduceOp.MAX).cpu()


@dataclass
class WorstSteps:
    """Per parameter, the step whose gradient was nearest its bound (k x reference + floor), for the
    whole parameter and for its worst row apart; and per step the worst parameter's figures."""

    k: float
    floor: float
    whole: torch.Tensor | None = None  # [P, 4] the worst step's first four COLUMNS
    rows: torch.Tensor | None = None  # [P, 2] the worst step's row figures
    whole_step: list[int] = field(default_factory=list)
    rows_step: list[int] = field(default_factory=list)
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # step, max rel L2, of bound

    def add(self, step: int, errors: torch.Tensor) -> None:
        whole, rows = errors[:, :4], errors[:, 4:]
        whole_of = self._of_bound(whole[:, 2], whole[:, 3])
        rows_of = self._of_bound(rows[:, 0], rows[:, 1]).masked_fill(rows[:, 0] == NO_ROWS, 0.0)
        self.curve.append((step, float(whole[:, 2].max()), float(torch.maximum(whole_of, rows_of).max())))
        if self.whole is None:
            self.whole, self.rows = whole.clone(), rows.clone()
            self.whole_step, self.rows_step = [step] * len(errors), [step] * len(errors)
            return
        for i in range(len(errors)):
            if whole_of[i] > self._of_bound(self.whole[i, 2], self.whole[i, 3]):
                self.whole[i], self.whole_step[i] = whole[i], step
            if rows_of[i] > self._of_bound(self.rows[i, 0], self.rows[i, 1]):
                self.rows[i], self.rows_step[i] = rows[i], step

    def row_fields(self, i: int) -> dict:
        """ParamRow's gradient fields of parameter i."""
        row, ref = (None, None) if self.rows[i, 0] == NO_ROWS else map(float, self.rows[i])
        return {
            **dict(zip(COLUMNS[:4], map(float, self.whole[i]), strict=True)),
            "grad_step": self.whole_step[i],
            "grad_row_rel_l2": row,
            "grad_row_ref_rel_l2": ref,
            "grad_row_step": None if row is None else self.rows_step[i],
        }

    def _of_bound(self, value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        return value / (self.k * reference + self.floor)


def _row_errors(
    name: str, g: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, head_dim: int
) -> list[float]:
    """The worst row's relative error of `g` against `want` and of `want` against `exact`."""
    if g.dim() != 2:
        return [NO_ROWS, NO_ROWS]
    g, want, exact = (rows(name, t, head_dim) for t in (g, want, exact))
    norms = want.norm(dim=1)
    rms = norms.pow(2).mean().sqrt().clamp(min=1e-300)
    scale = torch.where(norms > 0, norms, rms)  # a row no token reached: 0 in every model
    return [float(((g - want).norm(dim=1) / scale).max()), float(((want - exact).norm(dim=1) / scale).max())]


def rows(name: str, t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A matrix's rows as the row check takes them: [R, -1] (module docstring)."""
    out, inp = t.shape
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and out % head_dim == 0:
        return t.reshape(out // head_dim, head_dim * inp)  # [heads, head_dim x H]
    if name.endswith("o_proj.weight") and inp % head_dim == 0:
        return t.reshape(out, inp // head_dim, head_dim).transpose(0, 1).reshape(inp // head_dim, -1)
    return t


def _rel_l2(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """||a - b|| / ||scale||, in fp64."""
    return (a.double() - b.double()).norm() / scale.double().norm().clamp(min=1e-30)
