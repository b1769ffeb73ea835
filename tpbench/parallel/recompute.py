"""Activation recompute (`train.recompute`): keep fewer activations, run part of the forward again in
backward. The names are Megatron's `--recompute-granularity` and torchtitan's `activation_checkpoint.mode`.

| mode      | what a block keeps for backward                  | recomputed in backward               |
|-----------|--------------------------------------------------|--------------------------------------|
| none      | everything its ops save (tpbench.predict.theory) | nothing                              |
| selective | all but the SwiGLU's product                     | silu(gate) * up                      |
| full      | its input only: the [S/T, B, H] shard under SP   | the block, up to its last save       |

Selective follows Korthikanti et al. (2022) section 5: recompute what is large to keep and cheap to
make again. Their choice, the attention core's [S, S] softmax, is already recomputed by the fused SDPA
kernel (it keeps the output and the logsumexp only), so here the large and cheap parts are the
elementwise ones. The model itself already remakes two of them at no matmul's cost, with or without
recompute: each RMSNorm keeps its input only (model.lean_rmsnorm, which auto turns on wherever
recompute is asked for) and the fused silu-mul keeps gate and up (model.fused_swiglu). What is
left is the SwiGLU's product silu(gate) * up, down_proj's input
(I wide, the largest per-token term of the block): selective keeps gate and up only and makes the
product again at down_proj's backward. No matmul is run again, so the FLOPs a counter sees do not
change. The autograd graph is the one of `none`: the gradients are bit-identical. (MiniMind's own
ops, model.lean_rmsnorm=false or model.fused_swiglu=false, are there to measure the seed's step as it
is: tpbench.run.compose refuses recompute with them.)

Full wraps each block in torch.utils.checkpoint (non-reentrant). Its recomputation stops early, at
the block's last saved tensor (down_proj's input), so it issues the block's forward collectives up
to there again: the entry all-gathers (g: of both regions, or of the 5 column linears under
sp_gather=linear) and the attention's exit (f-bar or g-bar),
counted under the purpose "recompute". SP's re-gather hooks are not installed under full: the block
keeps nothing of the gathered input, the recomputed forward gathers it again.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tpbench.models.minimind import MiniMindForCausalLM, drop, swiglu
from tpbench.parallel import instrumentation
from tpbench.parallel.layers import RowParallelLinear
from tpbench.parallel.wrappers import Region, behaviour, wrap

MODES = ("none", "selective", "full")


def apply_recompute(model: MiniMindForCausalLM, mode: str) -> None:
    """Make every block of `model` (dense or sharded) recompute in backward as `mode` says."""
    if mode not in MODES:
        raise ValueError(f"train.recompute={mode!r}: accepted are {', '.join(MODES)}")
    if mode == "none":
        return
    for block in model.model.layers:
        if mode == "full":
            wrap(block, Checkpointed)
        else:
            wrap(block.mlp, SelectiveSwiGLU)


# --- full --------------------------------------------------------------------------------------


def _recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward, recomputation) contexts of torch.utils.checkpoint: collectives of the second count
    under the purpose "recompute"."""
    return contextlib.nullcontext(), instrumentation.recomputing()


class Checkpointed:
    """A block's behaviour (tpbench.parallel.wrappers.wrap) under full: its forward, the regions'
    entries and exits in it included, runs under torch.utils.checkpoint (non-reentrant). Compiled
    (train.compile), the recomputation is the compiled backward's, whose collectives count under
    their forward purpose: a compiled checkpoint takes no context but dispatch modes."""

    def forward(self, x: torch.Tensor, *args):
        if torch.compiler.is_compiling():
            return checkpoint(super().forward, x, *args, use_reentrant=False)
        return checkpoint(super().forward, x, *args, use_reentrant=False, context_fn=_recompute_contexts)


behaviour(Checkpointed, before=Region)  # outside the entries: the recomputation gathers again


# --- selective ---------------------------------------------------------------------------------


class SelectiveSwiGLU:
    """An MLP's behaviour (tpbench.parallel.wrappers.wrap) under selective: keep gate and up only. The
    checkpointed function ends with down_proj's local matmul, so that its input, silu(gate) * up, is
    recomputed too; the recomputation stops early, when that matmul saves its input, before the
    matmul itself runs. A row-parallel down_proj reduces after it, and the MLP's dropout follows, as
    in FeedForward. Inside the region's entry."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        row = isinstance(down, RowParallelLinear)

        def swiglu_down(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return F.linear(swiglu(gate, up), down.weight, None if row else down.bias)

        gate, up = self.gate_proj(x), self.up_proj(x)  # [S, B, I/T] each
        y = checkpoint(swiglu_down, gate, up, use_reentrant=False, preserve_rng_state=False)
        return drop(self.dropout, down.reduce(y) if row else y)  # [S(/T), B, H]


behaviour(SelectiveSwiGLU, before=None)  # inside the entry: the MLP's own forward, made again
