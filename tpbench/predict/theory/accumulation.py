"""Gradient accumulation (train.accumulation = K, tpbench.experiments.training): a step of K
micro-batches per DP rank, each one's forward and backward as a step of one micro-batch, then one
DP gradient sync and one optimizer step. What it changes in the model of a step:

Collectives (`accumulated`), from one micro-batch's step (tpbench.predict.theory.collectives):
  per micro-batch, K times   TP's own (activation, regather, recompute, loss: inside forward and
                             backward) and FSDP2's all-gathers of each unit's weights (dp_params
                             under dp_shard=grads or full: gathered again for every forward, and
                             under full for every backward)
                             and under FSDP2 (dp_shard=grads or full) the DP gradient sync too
                             (dp_grads: each unit's reduce-scatter, HSDP's all-reduce), torchtitan's
                             choice: the gradients stay sharded, each micro-batch's added into them
  once a step                the other levels' DP gradient sync (dp_grads: DDP's bucket
                             all-reduces, megatron's DP sum, ZeRO-1's reduce-scatter), the TP
                             gradient sums (grad_sum: in finish_grads, on the accumulated
                             gradients), the global norm's (grad_norm, train.grad_clip: after
                             them) and ZeRO-1's all-gather of the stepped shard (dp_params,
                             in the optimizer step)

Memory: not modelled for K > 1 (tpbench.predict.checked refuses kind=memory there). What persists
between micro-batches is named in docs/theory.md: DDP's buckets and ZeRO-1's grad buffer hold the
accumulating gradients as they do in one micro-batch's step, while FSDP2 with its gradient sync off
keeps every unit's gradients unsharded (in the reduce dtype) from the first backward to the last.
"""

from __future__ import annotations

from dataclasses import replace

from tpbench.config import RunConfig
from tpbench.predict.theory.sharding import GRADS, PARAMS, sharding
from tpbench.results import CommRow

# synced once a step, on the accumulated gradients: the DP sync, the TP sums, train.grad_clip's norm
ONCE = (GRADS, "grad_sum", "grad_norm")
FSDP2 = ("grads", "full")  # the levels whose gradient sync runs every micro-batch


def once_a_step(cfg: RunConfig, row: CommRow) -> bool:
    """Whether a collective of one micro-batch's step runs once a step under accumulation (else once
    per micro-batch)."""
    level = sharding(cfg).level
    if row.purpose == GRADS and level in FSDP2:  # reduce-scattered (HSDP: all-reduced) every backward
        return False
    return row.purpose in ONCE or (row.purpose == PARAMS and level == "optimizer")  # ZeRO-1's gather


def accumulated(cfg: RunConfig, rows: list[CommRow]) -> list[CommRow]:
    """One step's collectives under train.accumulation from one micro-batch's step's `rows`."""
    k = cfg.train.accumulation
    if k == 1:
        return rows
    return [r if once_a_step(cfg, r) else replace(r, count=r.count * k, bytes=r.bytes * k) for r in rows]
