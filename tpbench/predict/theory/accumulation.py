"""Gradient accumulation (train.accumulation = K, tpbench.experiments.training): a step of K
micro-batches per DP rank, each one's forward and backward as a step of one micro-batch, then one
DP gradient sync (FSDP2: one every micro-batch) and one optimizer step. What it changes in the model
of a step:

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

Memory (`step_moments`): the last micro-batch's moments, with what the earlier ones leave: every
gradient (autograd's own; DDP's beside its buckets under no_sync; ZeRO-1's grad buffer; FSDP2's
shards of every unit, each reduce-scatter's output a temporary added into them) and their losses;
the whole local batch's ids and labels at every moment. docs/theory.md, "Gradient accumulation".
"""

from __future__ import annotations

from dataclasses import replace

from tpbench.config import RunConfig
from tpbench.predict.theory import sharding as sharded
from tpbench.predict.theory import weights
from tpbench.predict.theory.activations import layer_activations, model_activations
from tpbench.predict.theory.dims import FP32, INT64, Dims
from tpbench.predict.theory.moments import Moment
from tpbench.predict.theory.sharding import GRADS, PARAMS, Sharding, sharding
from tpbench.predict.theory.shards import unit_shards
from tpbench.results import CommRow

# synced once a step, on the accumulated gradients: the DP sync, the TP sums, train.grad_clip's norm
ONCE = (GRADS, "grad_sum", "grad_norm")
FSDP2 = ("grads", "full")  # the levels whose gradient sync runs every micro-batch
# the moments after the last backward: the gradient sums, clipping's norm, the optimizer step
AFTER = ("gradient sums", "gradient clipping", "optimizer")
# the moments of a micro-batch before its loss is divided by K (train.accumulation's loss / K, alive
# through its backward): the forward's
FORWARD = ("loss forward", "attention forward", "attention dropout", "top block all-gather",
           "final norm forward", "head forward")  # fmt: skip


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


def step_moments(d: Dims, k: int, out: list[Moment], later: list[Moment] | None = None) -> list[Moment]:
    """The moments of a step of `k` micro-batches from one micro-batch's step's (`out`, in order,
    ending with AFTER's). Every moment holds the whole local batch's ids and labels (the micro-batches
    are views of it: K times one micro-batch's). A micro-batch's moments from its loss on hold
    `loss / K` (fp32, what backward starts from); the last micro-batch's hold the gradients the
    earlier ones left (`held`: the step's gradients at the first of AFTER's moments, and the earlier
    losses, fp32 each), so that every moment of the first is at most its own in the last, which alone
    is listed. After the last backward: the K losses the step averages. `later`: FSDP2's moments of
    a later micro-batch (tpbench.predict.theory.sharding.moments, accumulating), whose gradients they
    count (every unit's shard beside the whole ones being made)."""
    if k == 1:
        return out
    end = next(i for i, m in enumerate(out) if m.name in AFTER)
    batch = (k - 1) * 2 * INT64 * d.B * d.dp * d.S
    held = out[end].grads
    if d.dp_shard == "optimizer":  # ZeRO-1's grad buffer, the gradients accumulating in it
        held = out[end - 1].grads
    elif d.ddp and d.bucket_view:  # DDP's no_sync: autograd's own gradients beside the buckets, whose
        held += weights.param_bytes(d)  # views they become at the last micro-batch's sync only
    losses = (k - 1) * FP32
    last = [
        replace(m, grads=m.grads if later else max(m.grads, held), activations=m.activations + batch + losses
                + (0 if m.name in FORWARD or (m.name == "loss" and d.vp and not d.logits_mean) else FP32))
        for m in ([m for m in later if m.name not in AFTER] if later else out[:end])
    ]  # fmt: skip
    return last + [replace(m, activations=m.activations + batch + losses) for m in out[end:]]


def top_input_norm_backward(d: Dims, s: Sharding, later: list[Moment]) -> list[Moment]:
    """FSDP2, a later micro-batch: the input RMSNorm backward of the top block and of the one below it,
    the moment sharding.moments' "input norm backward 0" is for block 0, where every unit's shard is
    held (so a higher block's moment holds what block 0's does and the blocks below's saved tensors
    too). Their gradients as block 0's (the blocks are alike: the block's whole, the root's own, every
    shard); their weights the block's (under grads every block's up to it, gathered since forward);
    their temporaries the block above's reduce-scatter input (the top block's none, no reduce-scatter
    having run yet) and under full the block below prefetched. None at L 1."""
    c = sharded.computing(d, s)
    bottom = next(m for m in later if m.name == "input norm backward 0")
    n = unit_shards(d, s.D)
    blocks = [f"layers.{i}" for i in range(d.L)]
    gathered = {b: s.D * n[b] * c.w for b in blocks}
    per_block = model_activations(c)["blocks"] // d.L
    if d.recompute == "full":
        per_block = sum(layer_activations(c).values())
    out = []
    for i in sorted({d.L - 1, d.L - 2} - {0, -1}):
        params = bottom.params + (sum(gathered[b] for b in blocks[1 : i + 1]) if s.level == "grads" else 0)
        temps = bottom.temporaries - (s.D * n[blocks[1]] * d.w if i == d.L - 1 else 0)
        temps += gathered[blocks[i - 1]] if s.level == "full" else 0
        activations = bottom.activations + per_block * i
        out.append(replace(bottom, name=f"input norm backward {i}", params=params, activations=activations,
                           temporaries=temps))  # fmt: skip
    return out
