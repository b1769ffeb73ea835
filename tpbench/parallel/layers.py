"""Tensor-parallel layers (Megatron-style), holding one rank's shard of a dense weight.

Math convention Y = X W with W [in, out]; PyTorch stores `weight` as [out, in], so
column parallel splits `weight` on dim 0 and row parallel on dim 1.

The layers do their own local math and, for row/vocab layers, the reduction that ends a region.
The *entry* of a region (f or g) is applied once per region by the plan (tpbench.parallel.plan),
not once per layer: q, k and v share one input and so share one f (or one all-gather under SP).
Under SP with parallel.sp_gather=linear the plan puts g in front of each column linear instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpbench.parallel import collectives, regions
from tpbench.parallel.wrappers import tp_size


class ColumnParallelLinear(nn.Module):
    """Y_t = X W[:, cols_t] (+ b_t). weight [out/T, in]; the output is sharded on its last dim
    and the bias is split with it. No communication: the region's entry op (f or g) precedes it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        # an existing Parameter is kept as it is: the LM head tied to the embedding shard
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    def extra_repr(self) -> str:
        out, in_ = self.weight.shape
        return f"{in_} -> {out}" + (", bias" if self.bias is not None else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [..., in] -> [..., out/T]


class RowParallelLinear(nn.Module):
    """Y = sum_t X_t W[rows_t, :] + b. weight [out, in/T]; the input is sharded on its last dim.
    Ends a region: all-reduce (f-bar), or reduce-scatter into the SP layout (g-bar) when
    `reduce="reduce_scatter"`. The bias is added once, after the reduction."""

    def __init__(
        self,
        weight: torch.Tensor,
        group: collectives.Group,
        reduce: str = "all_reduce",
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        if reduce not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduce={reduce!r}: accepted are all_reduce, reduce_scatter")
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group = group
        self.reduction = reduce

    def extra_repr(self) -> str:
        out, in_ = self.weight.shape
        bias = ", bias" if self.bias is not None else ""
        return f"{in_} -> {out}{bias}; exit {self.reduction} over tp {tp_size(self.group)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight))  # [S, B, out], a partial sum over the TP ranks

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (f-bar), or reduce-scatter them (g-bar); add the bias."""
        if self.reduction == "all_reduce":
            out = regions.reduce_from_tp_region(partial, self.group)  # [S, B, out]
        else:
            out = regions.reduce_scatter_to_sp_region(partial, self.group)  # [S/T, B, out]
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank t owns vocab rows [t*V/T, (t+1)*V/T) of a (padded) table. Ids outside the range look up
    local row 0 and are zeroed; the partial outputs are summed over the TP group by all-reduce, or
    reduce-scattered straight into the SP layout."""

    def __init__(
        self, weight: torch.Tensor, tp_rank: int, group: collectives.Group, reduce: str = "all_reduce"
    ):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [V/T, H]
        self.vocab_start = tp_rank * weight.shape[0]
        self.group = group
        self.reduce = reduce

    def extra_repr(self) -> str:
        rows, h = self.weight.shape
        start = self.vocab_start
        exit_ = f"exit {self.reduce} over tp {tp_size(self.group)}"
        return f"vocab rows {start}..{start + rows - 1}, {h}; {exit_}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [S, B, H], partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce == "all_reduce":
            return regions.reduce_from_tp_region(out, self.group)  # [S, B, H]
        return regions.reduce_scatter_to_sp_region(out, self.group)  # [S/T, B, H]
