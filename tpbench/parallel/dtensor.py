"""The same TP / SP / VP, written with PyTorch's own DTensor tensor parallelism, to compare with ours.

`parallelize_dtensor` shards the dense MiniMind in place with
`torch.distributed.tensor.parallel.parallelize_module` on the "tp" dim of the mesh, with a declarative
plan `{module path: ParallelStyle}` as torchtitan does for Llama:

| module                | tp                  | tp + sp                                 | + vp            |
|-----------------------|---------------------|-----------------------------------------|-----------------|
| embed_tokens          | (replicated)        | PrepareModuleOutput Replicate->Shard(0) | RowwiseParallel |
| input/post_attn norms | (replicated)        | SequenceParallel(sequence_dim=0)        |                 |
| self_attn, mlp        | PrepareModuleInput  | PrepareModuleInput Shard(0)->Replicate  |                 |
| q/k/v, gate/up        | ColwiseParallel     | ColwiseParallel                         |                 |
| o, down               | RowwiseParallel     | RowwiseParallel(output_layouts=Shard(0))|                 |
| q_norm, k_norm        | SequenceParallel(sequence_dim=2): the heads dim, see below    |                 |
| norm                  | (replicated)        | SequenceParallel(sequence_dim=0)        |                 |
| lm_head               | (replicated)        | PrepareModuleInput Shard(0)->Replicate  | ColwiseParallel |
| loss                  | cross entropy       | cross entropy                           | loss_parallel() |

Our hidden stream is sequence-first [S, B, H], so the sequence shard is Shard(0), not torchtitan's
Shard(1). The residual stream between blocks stays a plain (local) tensor, [S, B, H] or [S/T, B, H];
norms and region entries turn it into a DTensor, and the region exits (use_local_output) turn it back.

Attention reads its head counts off the projections' outputs, so q/k/v come out of ColwiseParallel
as local tensors [S, B, N/T * D] and attention runs per local head unchanged. q_norm / k_norm are
replicated but see only their rank's heads: SequenceParallel(sequence_dim=2) makes their weights
Replicate DTensors and their inputs Shard(2) (heads), so the weight gradient comes out Partial(sum);
the same holds for the norms under SP (Shard(0)). `finish_grads` redistributes those gradients to
Replicate (an all-reduce each). Left Partial, DTensor's optimizer would reduce them inside every op
that reads them, and the local gradients would not be the dense ones.

DTensor's collectives are torch's functional collectives, not tpbench.parallel.comm's: `counting`
counts them (`_CommBytes`, a dispatch mode below DTensor) into the same CommCounter, with the same
ring bytes.

What DTensor cannot express here, refused up front by `check_dtensor_shardable`: GQA with fewer KV
heads than ranks (ours replicates KV heads; ColwiseParallel would cut a head in half), and, under VP,
a vocab not divisible by tp (ours pads it; this engine keeps DTensor's even split).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from tpbench.config import ParallelConfig
from tpbench.models.minimind import IGNORE_INDEX, MiniMindForCausalLM
from tpbench.parallel import collectives, instrumentation
from tpbench.parallel.checks import GRAD_SUMS, check_dtensor_shardable
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.plan import Layout, plan_layouts, tp_styles, write_in_place
from tpbench.parallel.recompute import apply_recompute

# --- the plan ----------------------------------------------------------------------------------


def tp_plan(num_layers: int, sp: bool, vp: bool, qk_norm: bool = True) -> dict[str, object]:
    """{module path: ParallelStyle} for parallelize_module: the plan's table (plan.tp_styles, which
    our engine reads too), each style made DTensor's. Sequence shards are Shard(0). The q/k/v biases
    (model.attention_bias) are ColwiseParallel's Shard(0), cut with their weights' heads."""
    stream = Shard(0) if sp else Replicate()  # the residual stream between regions
    plan: dict[str, object] = {}
    for path, style in tp_styles(num_layers, sp, vp, qk_norm).items():
        if style == "vocab_embedding":  # embedding rows split: partial sums all-reduced or reduce-scattered
            plan[path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        elif style == "vocab_head":  # logits [S, B, V/T] stay a DTensor for loss_parallel
            plan[path] = ColwiseParallel(
                input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
            )
        elif style == "sp_split":
            plan[path] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        elif style == "sp_gather":  # the final norm runs on the shard; the LM head's input is gathered
            plan[path] = SequenceParallel(sequence_dim=0)
            plan["lm_head"] = PrepareModuleInput(
                input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_output=True
            )
        elif style == "sp_norm":
            plan[path] = SequenceParallel(sequence_dim=0)
        elif style == "entry" and path.endswith("self_attn"):  # (x, cos, sin)
            plan[path] = PrepareModuleInput(
                input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
            )
        elif style == "entry":
            plan[path] = PrepareModuleInput(input_layouts=stream, desired_input_layouts=Replicate())
        elif style == "column":
            plan[path] = ColwiseParallel()  # q/k/v -> local [S, B, N/T * D]
        elif style == "row":
            plan[path] = RowwiseParallel(output_layouts=stream)
        elif style == "head_norm":  # [S, B, N/T, D]: this rank's heads, dim 2
            plan[path] = SequenceParallel(sequence_dim=2, use_local_output=True)
        else:
            raise AssertionError(f"{path}: style {style!r} has no DTensor form")
    return plan


def parallelize_dtensor(
    model: MiniMindForCausalLM,
    ctx: ParallelContext,
    pcfg: ParallelConfig,
    skip_grad_sum: tuple[str, ...] = (),
    recompute: str = "none",
) -> DTensorParallelModel:
    """Shard `model` in place with parallelize_module on the tp dim of the layout's mesh (under HSDP
    the (dp_replicate, dp_shard, tp) one, whose DP dims FSDP2 then shards over); return it with the
    ParallelModel interface (tpbench.parallel.plan.ParallelModel).

    skip_grad_sum names entries of GRAD_SUMS (tpbench.parallel.checks) to leave out, only to prove each
    is needed: qk_norm (q/k norms left plain replicated weights), sp_norms (their Partial gradients left
    as they are), dp; kv_replicas has nothing to leave out (check_dtensor_shardable refuses them).
    recompute (train.recompute) is applied first, to the blocks (tpbench.parallel.recompute: what its
    policy does with DTensor's functional collectives is said there).
    """
    cfg = model.config
    check_dtensor_shardable(cfg, replace(pcfg, engine="dtensor", tp=ctx.tp))
    if unknown := set(skip_grad_sum) - set(GRAD_SUMS):
        raise ValueError(f"skip_grad_sum={sorted(unknown)}: accepted are {', '.join(GRAD_SUMS)}")
    layouts = plan_layouts(cfg, ctx.tp, replace(pcfg, vocab_pad_multiple=1))
    apply_recompute(model, recompute)  # a block's class swapped: parallelize_module hooks its children
    if ctx.tp > 1:
        plan = tp_plan(cfg.num_hidden_layers, pcfg.sp, pcfg.vp, cfg.qk_norm)
        if "qk_norm" in skip_grad_sum:  # q/k norms as plain replicated weights: nothing sums their grads
            plan = {k: v for k, v in plan.items() if not k.endswith(("q_norm", "k_norm"))}
        parallelize_module(model, ctx.with_replicas(pcfg.dp_replicate).tp_mesh, plan)
        if pcfg.vp:
            model.loss_fn = LossParallelCrossEntropy()
            if cfg.tie_word_embeddings:  # both [V, H] Shard(0): tie the lm_head to the embedding again
                model.lm_head.weight = model.model.embed_tokens.weight
    pm = DTensorParallelModel(model, ctx, pcfg, layouts, skip_grad_sum)
    _check_placements(pm)
    model.named_parameters = types.MethodType(_named_local_shards, model)
    model.parameters = types.MethodType(_dtensor_parameters, model)
    return pm


# --- the vocab-parallel loss -------------------------------------------------------------------


class LossParallelCrossEntropy(nn.Module):
    """CausalLMLoss on vocab-sharded DTensor logits, under torch's `loss_parallel()`.

    loss_parallel needs its backward under the context as well, but the caller runs backward later;
    so the cross entropy is its own small graph, kept from forward and differentiated in backward
    under the context. Returns the local (replicated) loss scalar."""

    def forward(self, logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
        return _LossParallel.apply(logits, targets)


class _LossParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):
        # logits DTensor [S, B, V] Shard(2), local [S, B, V/T]; targets [S, B] global ids
        with torch.enable_grad(), loss_parallel(), _purpose("loss"):
            ctx.leaf = logits.detach().requires_grad_()
            ctx.loss = F.cross_entropy(
                ctx.leaf.float().flatten(0, 1), targets.reshape(-1), ignore_index=IGNORE_INDEX
            ).to_local()
        return ctx.loss.detach()

    @staticmethod
    def backward(ctx, grad):
        with loss_parallel(), _purpose("loss"):
            (dlogits,) = torch.autograd.grad(ctx.loss, ctx.leaf, grad)
        del ctx.loss, ctx.leaf
        return dlogits, None


# --- the model and its interface ---------------------------------------------------------------


@dataclass
class DTensorParallelModel:
    """The DTensor-parallel module with the interface of tpbench.parallel.plan.ParallelModel.

    The module's parameters are DTensors (Shard or Replicate on the "tp" dim), and its optimizer
    steps on them as torchtitan's does: `module.parameters()` yields the DTensors. For the checks,
    `module.named_parameters()` yields this rank's local shards as plain tensors whose .grad is the
    local gradient, like our plan's modules.
    """

    module: MiniMindForCausalLM
    ctx: ParallelContext
    config: ParallelConfig
    layouts: dict[str, Layout]
    skip_grad_sum: tuple[str, ...] = ()
    # debug.low_precision_reduce under mixed precision: the DP sum's dtype (bf16), not its fp32 grads'
    dp_reduce_dtype: torch.dtype | None = None

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        """-> (logits [B, S, V] or this rank's [B, S, V/T] under VP, loss)."""
        logits, loss = self.module(input_ids, labels)
        return _local(logits), loss

    def finish_grads(self) -> None:
        """Partial gradients of replicated weights (q/k norms; the norms under SP) are all-reduced
        to their parameters' Replicate placement (DTensor.redistribute); then the DP average."""
        params = dict(nn.Module.named_parameters(self.module))
        with _purpose("grad_sum"):
            for name, p in params.items():
                if not isinstance(p.grad, DTensor) or p.grad.placements == p.placements:
                    continue
                if self.layouts[name].grad_sum not in self.skip_grad_sum:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)  # Partial -> Replicate
        if self.ctx.dp > 1 and "dp" not in self.skip_grad_sum:
            grads = [_local(p.grad) for p in params.values() if p.grad is not None]
            collectives.all_reduce_coalesced(
                grads, self.ctx.dp_group, "dp_grads", average=True, dtype=self.dp_reduce_dtype
            )  # local tensors, in place

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Each parameter's gradient on this rank: its local TP shard (as validate compares them)."""
        return {n: p.grad for n, p in self.module.named_parameters()}

    def write_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        write_in_place(self.full_gradients(), grads)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Each parameter's local TP shard, as full_gradients."""
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def semantics(self, name: str) -> str:
        return self.layouts[name].semantics

    def shard_like(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """This rank's part of a dense tensor of parameter `name` (DTensor's Shard: torch.chunk)."""
        return self.layouts[name].shard(dense, self.ctx.tp, self.ctx.tp_rank)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One dense state dict with the dense names (DTensor.full_tensor: collective over TP)."""
        return {n: _full(t) for n, t in self.module.state_dict().items()}

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, S, V/T] vocab-sharded logits -> [B, S, V], for checks only."""
        if not self.config.vp or self.ctx.tp == 1:
            return logits
        shards = logits.detach().movedim(-1, 0).contiguous()  # [V/T, B, S]
        return collectives.all_gather(shards, self.ctx.tp_group, "check").movedim(0, -1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()


def _named_local_shards(
    self: nn.Module, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """named_parameters of the parallelized module: each DTensor as its local shard (same storage),
    with the local gradient attached."""
    for name, p in nn.Module.named_parameters(self, prefix, recurse, remove_duplicate):
        if not isinstance(p, DTensor):
            yield name, p
            continue
        local = p.to_local().detach()
        if p.grad is not None:
            local.grad = p.grad.to_local()
        yield name, local


def _dtensor_parameters(self: nn.Module, recurse: bool = True) -> Iterator[nn.Parameter]:
    for _, p in nn.Module.named_parameters(self, recurse=recurse):
        yield p


def _check_placements(pm: DTensorParallelModel) -> None:
    """Every parameter is placed as its layout says (Shard(dim) or replicated), so shard_like and the
    checkpoint mapping agree with what parallelize_module did."""
    for name, p in nn.Module.named_parameters(pm.module):
        layout = pm.layouts[name]
        placement = p.placements[0] if isinstance(p, DTensor) else Replicate()
        expected = Replicate() if layout.dim is None or pm.ctx.tp == 1 else Shard(layout.dim)
        if placement != expected:
            raise AssertionError(f"{name}: placed {placement}, its layout {layout} expects {expected}")


# --- counting DTensor's collectives ------------------------------------------------------------

_FUNCOL = torch.ops._c10d_functional
_current_purpose = "activation"


@contextlib.contextmanager
def _purpose(name: str) -> Iterator[None]:
    global _current_purpose
    previous, _current_purpose = _current_purpose, name
    try:
        yield
    finally:
        _current_purpose = previous


class _CommBytes(TorchDispatchMode):
    """Hands each functional collective DTensor issues (its ops desugar below this mode) to an
    instrumentation.CommCounter, with the ring-bytes convention of CommCounter.record. Not timed:
    DTensor's collectives are async.

    Not torch's CommDebugMode: its module tracker registers a forward hook on a module at each of the
    module's forwards without removing the last, so a module run twice inside one context pops its
    parent list twice and raises IndexError at the second forward (train.accumulation > 1; torch
    2.13's torch/distributed/tensor/debug/_comm_mode.py, `_fw_pre_hook`), and its global full backward
    pre-hook wraps every module's inputs in BackwardHookFunction, whose outputs MemTracker counts: the
    counted step of a memory run held two tensors more than any other (the RoPE tables, 2,048 B on
    the tiny model). The loss's collectives are told apart by `_purpose("loss")`, set around the
    vocab-parallel loss's forward and backward (_LossParallel)."""

    def __init__(self, counter: instrumentation.CommCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor desugars it into local ops and collectives, seen here next
        out = func(*args, **(kwargs or {}))
        if isinstance(func, torch._ops.HigherOrderOperator):
            return out
        packet = func._overloadpacket
        if packet == _FUNCOL.all_reduce:  # (input, op, group_name)
            x, group = args[0], args[2]
            self._record("all_reduce", x.numel() * x.element_size(), _group_size(group))
        elif packet == _FUNCOL.all_gather_into_tensor:  # (input, group_size, group_name)
            x, world = args[0], args[1]
            self._record("all_gather", x.numel() * x.element_size() * world, world)
        elif packet == _FUNCOL.reduce_scatter_tensor:  # (input, op, group_size, group_name)
            x, world = args[0], args[2]
            self._record("reduce_scatter", x.numel() * x.element_size(), world)
        return out

    def _record(self, op: str, full_bytes: int, world: int) -> None:
        self.counter.record(op, instrumentation.counted_purpose(_current_purpose), full_bytes, world, 0.0)


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


@contextlib.contextmanager
def counting(counter: instrumentation.CommCounter) -> Iterator[instrumentation.CommCounter]:
    """instrumentation.counting for the DTensor engine: counts DTensor's collectives (`_CommBytes`) and
    tpbench's own (the DP gradient average) into one CommCounter. Use instead of
    instrumentation.counting when parallel.engine == "dtensor"."""
    with instrumentation.counting(counter), _CommBytes(counter):
        yield counter
