"""Where each dropout's shard sits in the dense tensor: the counterpart of Megatron's RNG tracker.

Megatron draws a replicated activation's mask from a generator seeded alike on every TP rank and a
sharded one's from a generator seeded per TP rank. tpbench's dropouts draw each element's mask from
its dense position (tpbench.models.dropout), so all they need is where their shard sits:

| dim      | split over | when                  | dropouts                                   |
|----------|------------|-----------------------|--------------------------------------------|
| batch    | DP ranks   | dp > 1                | all: each DP rank takes its slice          |
| head     | TP ranks   | tp > 1                | attention probabilities [B, N/T, S, S]     |
| seq      | TP ranks   | SP                    | the stream's: embedding, after o_proj/down |

A dim not split is whole on this rank: the mask of a replicated activation (the stream under plain
TP) is the same on every TP rank, a sharded one's is this rank's slice of the dense mask.
"""

from __future__ import annotations

from torch import nn

from tpbench.models.dropout import PositionalDropout


def place_dropouts(
    model: nn.Module, tp_rank: int, tp: int, dp_rank: int, dp: int, sp: bool, fault: str = ""
) -> int:
    """Tell every dropout of `model` which part of each dense dim it holds; returns how many.

    fault (debug.dropout_fault, tpbench.parallel.names.DROPOUT_FAULTS): one dim's offset left out, every
    rank drawing the mask of part 0 there (as one seed shared where a shard needs its own), to prove
    that validation sees it."""
    splits = {"batch": (dp_rank, dp), "head": (tp_rank, tp)}
    if sp:
        splits["seq"] = (tp_rank, tp)
    if fault:
        name = fault.removeprefix("no_").removesuffix("_offset")
        if name in splits:
            splits[name] = (0, splits[name][1])
    dropouts = [m for m in model.modules() if isinstance(m, PositionalDropout)]
    for m in dropouts:
        m.splits = {name: part for name, part in splits.items() if name in m.dims and part[1] > 1}
    return len(dropouts)
