"""Activation recompute (`train.recompute`): keep fewer activations, run part of the forward again in
backward. The names are Megatron's `--recompute-granularity` and torchtitan's `activation_checkpoint.mode`.

| mode      | what a block keeps for backward                  | recomputed in backward               |
|-----------|--------------------------------------------------|--------------------------------------|
| none      | everything its ops save (tpbench.predict.theory) | nothing                              |
| selective | all but the SwiGLU's product                     | silu(gate) * up                      |
| full      | its input only: the [S/T, B, H] shard under SP   | the block, up to its last save       |
| op        | the outputs of the ops in `SAVED` (every second  | the rest of the block, up to its     |
|           | mm not), its collectives' included               | last save                            |

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

Op is torchtitan's default selective activation checkpointing (`SelectiveAC`, its
`activation_checkpoint.mode = "selective"` per op, torchtitan/distributed/activation_checkpoint.py):
each block runs under torch.utils.checkpoint with a policy of torch's selective checkpoint API
(`create_selective_checkpoint_contexts`) that keeps the output of every op in `SAVED` and recomputes
the rest, except that of the matmuls (aten.mm, aten.linear) only the odd ones of a block's forward
are kept: q_proj (1st), v_proj (3rd), gate_proj (5th), down_proj (7th) of a Llama block, k_proj,
o_proj and up_proj made again. The list, per engine:

- both: torch's compute-intensive ops (aten.mm, addmm, bmm, _scaled_mm), SDPA's kernels (flash,
  efficient, cudnn, math, and on a CPU aten._scaled_dot_product_flash_attention_for_cpu, which
  torchtitan's list does not name: tpbench keeps it, so that a CPU run keeps what a GPU run keeps)
  and aten.max (the amax of low-precision scaling). addmm and bmm are kept always (torchtitan counts
  mm and linear only): q, k, v with biases (Qwen2.5) and manual attention's two matmuls.
- tpbench's engine: its collectives (`tpbench.parallel.collectives`) run inside autograd Functions
  whose ops no dispatch mode sees one by one; inside an `op` block they go through the registered
  custom ops tpbench::all_reduce, all_gather and reduce_scatter (`collectives.as_custom_ops`), which
  the policy keeps, every one: the recomputation communicates nothing (torchtitan recomputes the
  all-gathers of SP; tpbench keeps them, as its counted collectives show). Out of place, the
  all-reduce of a row-parallel exit keeps its own result beside the partial sum. SP's re-gather hooks
  are not installed (the all-gather's output is kept).
- DTensor's engine: its collectives are functional ones, issued on local tensors by DTensor's
  redistributions (the ParallelStyles' hooks) where the policy's mode sees each:
  _c10d_functional.reduce_scatter_tensor and all_to_all_single kept, all_gather_into_tensor and
  all_reduce (and their wait_tensor) recomputed, as torchtitan's list has them. Under SP the
  recomputation all-gathers each region's input again and keeps the exits' reduce-scatters; under TP
  alone it all-reduces the attention's exit again (the MLP's comes after the early stop). Counted
  under "recompute" as tpbench's (`dtensor._CommBytes` reads the same purpose).

Every setting runs on the dtensor engine too (tpbench.parallel.dtensor applies it before
parallelize_module, which hooks the blocks' children): full and op as above, selective through
down_proj's own module, whose RowwiseParallel hooks make the product a Shard(-1) DTensor and reduce
its Partial output (`_swiglu_into`).

The recomputation stops at the block's last save (early stop, as under full), so down_proj's matmul
and what follows it are not run again. Compiled (train.compile), the same policy marks the graph's
ops, which the partitioner keeps or remakes.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tpbench.models.minimind import MiniMindForCausalLM, drop, swiglu
from tpbench.parallel import collectives, instrumentation
from tpbench.parallel.layers import RowParallelLinear
from tpbench.parallel.wrappers import Region, behaviour, wrap

MODES = ("none", "selective", "full", "op")


def apply_recompute(model: MiniMindForCausalLM, mode: str) -> None:
    """Make every block of `model` (dense or sharded) recompute in backward as `mode` says."""
    if mode not in MODES:
        raise ValueError(f"train.recompute={mode!r}: accepted are {', '.join(MODES)}")
    if mode == "none":
        return
    for block in model.model.layers:
        if mode == "full":
            wrap(block, Checkpointed)
        elif mode == "op":
            wrap(block, OpCheckpointed)
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
        if isinstance(down.weight, DTensor):  # the dtensor engine's RowwiseParallel: its hooks, its exit
            gate, up = self.gate_proj(x), self.up_proj(x)  # local [S, B, I/T] each
            y = checkpoint(_swiglu_into, down, gate, up, use_reentrant=False, preserve_rng_state=False)
            return drop(self.dropout, y)
        row = isinstance(down, RowParallelLinear)

        def swiglu_down(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return F.linear(swiglu(gate, up), down.weight, None if row else down.bias)

        gate, up = self.gate_proj(x), self.up_proj(x)  # [S, B, I/T] each
        y = checkpoint(swiglu_down, gate, up, use_reentrant=False, preserve_rng_state=False)
        return drop(self.dropout, down.reduce(y) if row else y)  # [S(/T), B, H]


def _swiglu_into(down: torch.nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """down_proj of the dtensor engine on the SwiGLU's product: the module, so that RowwiseParallel's
    hooks make its input a Shard(-1) DTensor and its Partial output the stream's layout. The
    recomputation stops when down_proj's matmul saves its input, before the matmul and its exit's
    collective run."""
    return down(swiglu(gate, up))


behaviour(SelectiveSwiGLU, before=None)  # inside the entry: the MLP's own forward, made again


# --- op ----------------------------------------------------------------------------------------

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.linear.default)  # counted: every second one of a block is made again
SAVED = frozenset(
    {
        *MATMULS,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_mm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._flash_attention_forward.default,
        aten._efficient_attention_forward.default,
        aten.max.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
        torch.ops.tpbench.all_reduce.default,
        torch.ops.tpbench.all_gather.default,
        torch.ops.tpbench.reduce_scatter.default,
    }
)


def op_policy():
    """A fresh policy for one block's forward and its recomputation: keep the ops of `SAVED`, but
    only the odd matmuls, counted apart in the forward and in the recomputation."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch's selective checkpoint contexts with a fresh `op_policy`, each with tpbench's collectives
    as custom ops (kept by the policy); the recomputation's would count under "recompute"."""
    forward, again = create_selective_checkpoint_contexts(op_policy())
    return _both(forward, collectives.as_custom_ops()), _both(
        again, collectives.as_custom_ops(), instrumentation.recomputing()
    )


@contextlib.contextmanager
def _both(*contexts: contextlib.AbstractContextManager):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


class OpCheckpointed:
    """A block's behaviour (tpbench.parallel.wrappers.wrap) under op: its forward, the regions'
    entries and exits in it, runs under torch.utils.checkpoint with the per-op policy. Compiled, the
    policy alone (a compiled checkpoint takes no context but torch's selective ones); the collectives
    are the custom ops there already."""

    def forward(self, x: torch.Tensor, *args):
        if torch.compiler.is_compiling():
            context = functools.partial(create_selective_checkpoint_contexts, op_policy())
            return checkpoint(super().forward, x, *args, use_reentrant=False, context_fn=context)
        return checkpoint(super().forward, x, *args, use_reentrant=False, context_fn=_op_contexts)


behaviour(OpCheckpointed, before=Region)  # outside the entries: their all-gathers are kept
