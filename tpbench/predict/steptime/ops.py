"""The ops of one training step on one rank: each with its class, FLOPs, bytes read and written and
the kernels it dispatches, from the model's sizes seen from one rank (`Dims`, the memory model's).

A step is forward -> loss -> backward -> AdamW. Per block (`layer_forward`), in the block's order:
the input RMSNorm, q/k/v, the q/k norms, RoPE, the attention core, o_proj, the residual add, the
post-attention norm, gate and up, SwiGLU, down_proj, the residual add (and the dropouts, with
model.dropout). Outside the blocks: the embedding, the final norm, the LM head, the loss, AdamW.

Backward (`backward_of`) is each op's gradient: a GEMM's two (input and weight gradient, twice the
forward's FLOPs), the flash attention kernel's backward (2.5x its forward: it remakes the scores),
an elementwise op's what its gradient reads and writes where that is plain from the op (the
residual add's: one add, where the stream's two gradients meet; dropout's: the gradient and the
mask read, one written; Megatron's fused norm and softmax: three passes), else twice the
forward's bytes; its kernels BACKWARD_KERNELS x the forward's (counted) unless it says. Recompute
adds forward ops again in backward: full, every op of a block up to down_proj's input (down_proj
too with dropout: the recomputation runs to the MLP dropout's mask); selective, the ops
`Implementation.selective` names (tpbench's: the SwiGLU; Megatron's: the attention core).

Bytes are what each kernel reads and writes at the element sizes of `Dims` (p activations, s the
stream, fp32 where RMSNorm, softmax and the loss compute); kernels are the aten ops dispatched,
counted from the model's code (each pays the fixed per-op cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tpbench.predict.theory.dims import FP32, Dims
from tpbench.predict.theory.flops import op_kept_linears
from tpbench.predict.theory.shards import flat_shard, zero_buckets
from tpbench.predict.theory.weights import params

GEMM, ATTENTION, ELEMENTWISE, OPTIMIZER = "gemm", "attention", "elementwise", "optimizer"
FORWARD, BACKWARD, RECOMPUTE, STEP = "forward", "backward", "recompute", "optimizer"


@dataclass(frozen=True)
class Implementation:
    """What differs between tpbench's kernels and Megatron-LM's (Korthikanti et al.'s GPT): what
    selective recompute remakes; whether dropout, the scaled masked softmax and the norm are one
    fused kernel each (Megatron's: the input read, the output (and a 1-byte mask) written) or
    tpbench's (a hashed mask; an fp32 softmax and its mask; RMSNorm's fp32 passes); RoPE (GPT has
    learned positions, added once at the embedding)."""

    selective: tuple[str, ...]
    fused_dropout: bool = False
    fused_softmax: bool = False
    fused_norm: bool = False
    rope: bool = True


TPBENCH = Implementation(selective=("swiglu",))
MEGATRON = Implementation(
    ("qk^T", "softmax", "attention dropout", "pv"),
    fused_dropout=True,
    fused_softmax=True,
    fused_norm=True,
    rope=False,
)
# backward dispatches 2.34 ops per forward op: the dense tiny model's step, counted by a dispatch mode
# (535 in backward, 229 in forward; benchmarks/time_model_grid.py --count prints them)
BACKWARD_KERNELS = 2.34


@dataclass(frozen=True)
class Op:
    """One op of the step on one rank: `count` identical kernels' worth of work, summed."""

    name: str
    kind: str  # gemm | attention | elementwise | optimizer
    flops: float
    bytes: float
    kernels: int  # aten ops dispatched: each pays the fixed per-op cost
    phase: str = FORWARD  # forward | backward | recompute | optimizer
    layer: bool = True  # inside a block (the blocks' ops are L x these)
    mnk: tuple[int, int, int] = (0, 0, 0)  # a GEMM's (m, n, k): its shape class
    backward_kernels: int | None = None  # None: BACKWARD_KERNELS x kernels
    backward_bytes: float | None = None  # what its gradient reads and writes; None: twice `bytes`
    # what it must move from and to memory where its passes reuse operands the cache holds (the rest
    # of `bytes` at the cache's rate); None: all of `bytes` from memory
    memory_bytes: float | None = None

    def times(self, n: float) -> Op:
        back = None if self.backward_kernels is None else round(self.backward_kernels * n)
        back_bytes = None if self.backward_bytes is None else self.backward_bytes * n
        return replace(
            self,
            flops=self.flops * n,
            bytes=self.bytes * n,
            kernels=round(self.kernels * n),
            backward_kernels=back,
            backward_bytes=back_bytes,
            memory_bytes=None if self.memory_bytes is None else self.memory_bytes * n,
        )


def gemm(name: str, m: int, n: int, k: int, p: int, batch: int = 1, kernels: int = 4) -> Op:
    """[m, k] @ [k, n] (`batch` of them): 2mnk FLOPs; reads both, writes the result. A linear
    dispatches 4 ops (t, view, mm, view)."""
    return Op(
        name, GEMM, 2.0 * batch * m * n * k, p * batch * (m * k + k * n + m * n), kernels, mnk=(m, n, k)
    )


def elementwise(
    name: str,
    elements: int,
    bytes_per_element: float,
    kernels: int,
    backward_kernels: int | None = None,
    backward_bytes_per_element: float | None = None,
) -> Op:
    """`backward_bytes_per_element`: what its gradient reads and writes per element, where that is
    known from the op (None: twice the forward's passes)."""
    back = None if backward_bytes_per_element is None else elements * backward_bytes_per_element
    return Op(
        name,
        ELEMENTWISE,
        float(elements),
        elements * bytes_per_element,
        kernels,
        backward_kernels=backward_kernels,
        backward_bytes=back,
    )


def residual_add(elements: int, s: int) -> Op:
    """The residual stream's add: two read, one written. Its gradient passes to both inputs as is;
    where the stream branches (into the norm and the add), autograd sums the two gradients: one add
    again (backward bytes = forward's)."""
    return elementwise("residual add", elements, 3 * s, 1, backward_bytes_per_element=3 * s)


def rmsnorm(name: str, rows: int, width: int, p: int, fused: bool = False) -> Op:
    """MiniMind's RMSNorm in fp32: x.float(), pow, mean, + eps, rsqrt, mul, type_as, * weight: the
    [rows, width] input read in p, five fp32 passes, the output written in p (7 ops dispatched);
    `fused`: one kernel, the input read and the output written."""
    if fused:  # backward: x and the output's gradient read, the input's written (the weight's: small)
        return elementwise(
            name, rows * width, 2 * p, kernels=1, backward_kernels=2, backward_bytes_per_element=3 * p
        )
    return elementwise(name, rows * width, 2 * p + 5 * FP32 + (0 if p == FP32 else FP32), kernels=7)


def layer_forward(d: Dims, impl: Implementation = TPBENCH) -> list[Op]:
    """One block's forward on one rank, in order."""
    N, Ns, H, p, s = d.N, d.Ns, d.H, d.p, d.s
    heads = d.B * d.Nq_l  # attention's batch of [S, S] products
    ops = [rmsnorm("input norm", Ns, H, s, impl.fused_norm)]
    if d.mixed:  # the region's input cast to the autocast dtype once (T > 1) or per linear
        ops.append(elementwise("input cast", N * H, s + p, 1 if d.cast_once else 3))
    ops += [
        gemm("q_proj", N, d.Hq, H, p),
        gemm("k_proj", N, d.Hkv, H, p),
        gemm("v_proj", N, d.Hkv, H, p),
    ]
    if d.qk_norm:
        ops += [
            rmsnorm("q norm", N, d.Hq, p, impl.fused_norm),
            rmsnorm("k norm", N, d.Hkv, p, impl.fused_norm),
        ]
    # RoPE on q and k: x * cos + rotate_half(x) * sin (the halves sliced, one negated, concatenated)
    if impl.rope:
        ops.append(elementwise("rope", N * (d.Hq + d.Hkv), 8 * p, kernels=14))
    if d.Nkv_l != d.Nq_l:  # GQA: k and v repeated to the query heads
        ops.append(elementwise("kv repeat", 2 * N * d.Hq, 2 * p, kernels=4))
    ops += attention_core(d, heads, impl)
    ops.append(gemm("o_proj", N, H, d.Hq, p))
    if d.dropout:
        ops.append(_dropout("o_proj dropout", Ns * H, p, impl))
    ops += [
        residual_add(Ns * H, s),
        rmsnorm("post-attention norm", Ns, H, s, impl.fused_norm),
    ]
    if d.mixed:
        ops.append(elementwise("mlp input cast", N * H, s + p, 1 if d.cast_once else 2))
    ops += [gemm("gate_proj", N, d.I_l, H, p), gemm("up_proj", N, d.I_l, H, p)]
    # silu(gate) * up: fused, one kernel reading both and writing the product; else silu, then mul
    ops.append(elementwise("swiglu", N * d.I_l, 3 * p if d.fused_swiglu else 5 * p, 2))
    ops.append(gemm("down_proj", N, H, d.I_l, p))
    if d.dropout:
        ops.append(_dropout("mlp dropout", Ns * H, p, impl))
    ops.append(residual_add(Ns * H, s))
    return ops


def attention_core(d: Dims, heads: int, impl: Implementation = TPBENCH) -> list[Op]:
    """softmax(Q K^T / sqrt(D) + mask) V over each of `heads` = B x Nq/T [S, S] products: the flash
    kernel (SDPA), or the manual attention's two batched GEMMs and its fp32 softmax (and dropout)."""
    S, D, p = d.S, d.D, d.p
    if d.flash:  # reads q, k, v, writes the output and its log-sum-exp
        flops = 4.0 * heads * S * S * D
        # with the permutes and reshapes around it: 16 ops
        return [Op("attention", ATTENTION, flops, p * heads * S * D * 4 + FP32 * heads * S, 16)]
    scores = heads * S * S
    ops = [
        gemm("qk^T", S, S, D, p, batch=heads),  # with the scaling
        # the causal mask made, added in fp32, softmax in fp32, cast back: [heads, S, S] passes
        elementwise("softmax", scores, 2 * p, 1, 1, backward_bytes_per_element=3 * p)
        if impl.fused_softmax
        else elementwise("softmax", scores, p + 4 * FP32 + (p if p != FP32 else 0), 36, 10),
    ]
    if d.dropout:
        ops.append(_dropout("attention dropout", scores, p, impl))
    return [*ops, gemm("pv", S, D, S, p, batch=heads)]


def _dropout(name: str, elements: int, p: int, impl: Implementation = TPBENCH) -> Op:
    """tpbench's dropout: each element's mask a hash of its position (tpbench.models.dropout: two
    int32 copies in its folds), the input read, the output and its 1-byte mask written. Backward:
    the output's gradient and the mask read, the input's gradient written."""
    if impl.fused_dropout:
        return elementwise(
            name, elements, 2 * p + 1, 1, backward_kernels=1, backward_bytes_per_element=2 * p + 1
        )
    return elementwise(
        name, elements, 2 * p + 1 + 4 * 4, 77, backward_kernels=2, backward_bytes_per_element=2 * p + 1
    )


def outside_forward(d: Dims) -> list[Op]:
    """The forward outside the blocks: the embedding's lookup, the final norm, the LM head, the loss."""
    N, H, V, p, s = d.N, d.H, d.V_l, d.p, d.s
    # the lookup and the RoPE tables (15 ops; VP: its mask, shift and zeroing too). Its gradient is
    # the table's, dense: [V/T, H] zeroed, the token rows' gradients added in (read, and the rows
    # read and written); tied to the head, the two gradients of the one weight are then added
    table = d.V_l * H * d.w
    embedding_grad = table + N * H * (s + 2 * d.w) + (3 * table if d.tied else 0)
    ops = [
        replace(
            elementwise("embedding", N * H, 2 * s, 15 + (6 if d.vp else 0)), backward_bytes=embedding_grad
        )
    ]
    if d.dropout:
        ops.append(_dropout("embedding dropout", d.Ns * H, s))
    ops += [rmsnorm("final norm", d.Ns, H, s), gemm("lm_head", N, V, H, p)]
    # cross entropy in fp32: the logits cast, log-softmax (max, exp-sum), the target's gathered;
    # vocab-parallel: the same passes and their all-reduced max and sums
    kernels = 13 if not d.vp else 30  # with the labels' shift
    if d.logits_mean:
        ops.append(elementwise("loss", N * V, p + FP32, 2))
    else:
        ops.append(elementwise("loss", N * V, p + 3 * FP32, kernels))
    return [replace(op, layer=False) for op in ops]


def backward_of(op: Op) -> Op:
    """An op's gradient: a GEMM's input and weight gradients (twice its FLOPs), the flash kernel's
    backward (2.5x: it remakes the scores), an elementwise op's gradient (what it reads and writes
    where the op says, else twice its passes)."""
    factor = 2.5 if op.kind == ATTENTION else 2.0
    kernels = op.backward_kernels if op.backward_kernels is not None else round(BACKWARD_KERNELS * op.kernels)
    back = 2 * op.bytes if op.backward_bytes is None else op.backward_bytes
    return replace(op, flops=factor * op.flops, bytes=back, kernels=kernels, phase=BACKWARD)


def recomputed(d: Dims, impl: Implementation = TPBENCH) -> list[Op]:
    """What recompute runs again in each block's backward: full, the forward up to down_proj's input
    (to the MLP dropout's mask with dropout, down_proj included); op, the same stretch but for what
    its policy kept (the linears of `op_kept_linears`, the attention kernel or manual attention's two
    batched matmuls); selective, the ops it names."""
    forward = layer_forward(d, impl)
    down = [op.name for op in forward].index("down_proj")
    cut = down + 2 if d.dropout else down  # to down_proj's input (with dropout: its mask made)
    if d.recompute == "full":
        return [replace(op, phase=RECOMPUTE) for op in forward[:cut]]
    if d.recompute == "op":
        kept = {*op_kept_linears(d), "attention", "qk^T", "pv"}
        return [replace(op, phase=RECOMPUTE) for op in forward[:cut] if op.name not in kept]
    if d.recompute == "selective":
        return [replace(op, phase=RECOMPUTE) for op in forward if op.name in impl.selective]
    return []


def optimizer(d: Dims) -> Op:
    """AdamW over this rank's parameters (its shard of them under ZeRO-1 or FSDP2): unfused (about a
    dozen passes over the parameters, gradients and moments) or fused (one kernel reading and
    writing them once)."""
    tensors = params(d)
    n = sum(count for _, count in tensors)
    if d.dp_shard == "optimizer":  # ZeRO-1's master pieces, one per bucket
        n, tensors = flat_shard(d, d.dp_shards), zero_buckets(d, d.dp_shards)
    elif d.dp_shard != "none":  # FSDP2's shard of each parameter
        n = math.ceil(n / d.dp_shards)
    if d.fused_adam:
        return Op("adamw", OPTIMIZER, 12.0 * n, 7 * d.w * n, 1, phase=STEP, layer=False)
    # torch's default on a CPU is the for-loop AdamW, 13 ops per parameter; on a GPU the foreach one
    # Its passes run a parameter at a time, each over that parameter's four tensors, which the cache
    # holds between them where it can: from memory, what the fused kernel moves (each read once, the
    # parameter and the moments written once); the rest of its passes at the cache's rate
    # (ZeRO-1's pieces are buckets, larger than a cache: every pass from memory)
    kernels = 12 if d.gpu else 13 * len(tensors)
    adamw = Op("adamw", OPTIMIZER, 12.0 * n, 24 * d.w * n, kernels, phase=STEP, layer=False)
    return adamw if d.dp_shard == "optimizer" else replace(adamw, memory_bytes=7 * d.w * n)


def grad_clip(d: Dims) -> list[Op]:
    """train.grad_clip (tpbench.parallel.clip), before AdamW: the global norm reads every gradient this
    rank steps once (a square and an add an element, summed in fp32), the scaling reads and writes them
    once: 3 w n bytes, 3 n FLOPs over n, this rank's gradients (ZeRO-1's pieces, FSDP2's shard of
    each). Kernels: a norm and a multiply per tensor (a CPU's foreach runs per tensor; a GPU's one
    each), and the scalar's ten (stack, norm, square, sqrt, the coefficient's add, reciprocal, multiply
    and clamp, isfinite, the host read). Its all-reduces are the memory model's (`grad_norm`)."""
    if not d.grad_clip:
        return []
    tensors = len(params(d))
    n = sum(count for _, count in params(d))
    per_tensor = 2 * tensors  # a norm and a multiply per tensor
    if d.dp_shard == "optimizer":  # ZeRO-1's pieces: a norm per parameter's part, a multiply per bucket
        n, per_tensor = flat_shard(d, d.dp_shards), tensors + len(zero_buckets(d, d.dp_shards))
    elif d.dp_shard != "none":
        n = math.ceil(n / d.dp_shards)
    kernels = (2 if d.gpu else per_tensor) + 10
    return [Op("grad clip", OPTIMIZER, 3.0 * n, 3 * d.w * n, kernels, phase=STEP, layer=False)]


def dp_copies(d: Dims) -> list[Op]:
    """What DP's gradient average (and FSDP2's parameter gathers) copy on the compute's thread, by
    engine: n this rank's parameters, w their bytes, p an activation's, D the shard group:
      DDP's buckets, parallel.overlap's flat ones   each gradient copied into its bucket as backward
          makes it (zero_grad(set_to_none) dropped the last step's view), each bucket averaged in
          place: 4 w n; a copy per parameter, a division per bucket
      the blocking average (collectives.all_reduce_coalesced)   concatenated, averaged, copied
          back: 6 w n
      ZeRO-1 (tpbench.parallel.zero)   the grad buffer zeroed, each gradient added in, each bucket's
          piece averaged: 4 w n + 2 w n / D
      FSDP2 (grads, full; a unit per block and the root)   each unit's gradients copied into its
          reduce-scatter input (2 w n), the shard averaged (2 w n / D); per gather (one a step, two
          with full: backward gathers again) the shard cast in (w + p per shard element) and the
          whole copied out (2 p n)"""
    tensors = params(d)
    n, w, D = sum(count for _, count in tensors), d.w, d.dp_shards  # noqa: N806
    if d.ddp or d.flat_dp:
        size, kernels = 4 * w * n, len(tensors) + 1
    elif d.dp_shard == "optimizer":  # an average per bucket's piece
        size, kernels = 4 * w * n + 2 * w * n / D, len(tensors) + 1 + len(zero_buckets(d, D))
    elif d.dp_shard in ("grads", "full"):
        gathers = 2 if d.dp_shard == "full" else 1
        size = 2 * w * n + 2 * w * n / D + gathers * ((w + d.p) * n / D + 2 * d.p * n)
        kernels = (d.L + 1) * (2 + 2 * gathers)
    elif d.dp > 1:  # a reshape each, the cat, the division, the split, the copies
        size, kernels = 6 * w * n, 2 * len(tensors) + 3
    else:
        return []
    return [Op("dp copies", ELEMENTWISE, float(n), size, kernels, BACKWARD, False)]


def step_ops(d: Dims, impl: Implementation = TPBENCH) -> list[Op]:
    """Every op of one training step on one rank, the blocks' L x each, in phase order."""
    layer = layer_forward(d, impl)
    outside = outside_forward(d)
    forward = [op.times(d.L) for op in layer] + outside
    backward = [backward_of(op).times(d.L) for op in layer] + [backward_of(op) for op in outside]
    extra = [op.times(d.L) for op in recomputed(d, impl)]
    return forward + extra + backward + dp_copies(d) + grad_clip(d) + [optimizer(d)]
