"""Sharded data parallelism (parallel.dp_shard, issue 38): what each level keeps on one rank, the
moments of its step, and its DP collectives. Every figure is derived from the rank's tensors
(tpbench.predict.theory.weights), nothing is fitted.

Levels, over the D = dp / dp_replicate ranks of a shard group (HSDP: replicated across the R =
dp_replicate groups):
  none       DDP: every DP rank keeps the whole parameters, gradients and AdamW state of its TP shard.
  optimizer  ZeRO-1, Megatron's distributed optimizer (tpbench.parallel.zero): the parameters and the
             gradients live in one flat buffer each, in buckets (`zero_buckets`) each padded to a
             multiple of D elements; AdamW steps this rank's 1/D piece of every bucket (under mixed
             fp32 copies; in pure precision the parameter buffer's own pieces, stepped in place: one
             copy of the weights) and keeps their moments only. Each bucket is reduce-scattered in
             place during backward and all-gathered in place beside the next forward.
  grads      FSDP2 with reshard_after_forward=False (ZeRO-2): parameters, gradients and AdamW state
             sharded on dim 0 per parameter (each padded to a multiple of D rows); each block's
             weights are gathered once in forward and kept through its backward.
  full       FSDP2's default (ZeRO-3): a block's weights are gathered for its forward, freed, and
             gathered again for its backward, where FSDP2 prefetches the next block's.
FSDP2's units are one per block and the root (embedding, final norm, LM head); the root is not
resharded after forward (FSDP2 keeps the root's parameters for backward, which needs them first).

What is modelled to the byte and what not (docs/theory.md, "Sharded data parallelism"): the sharded
state (parameters, gradients, AdamW's moments and step counters) follows FSDP2's and ZeRO-1's padding
exactly (tests/test_theory_sharded.py checks it against torch's own fully_shard); the moments of the
step reuse the unsharded model's activations and temporaries with the parameter, gradient and
optimizer categories replaced, plus the gathered weights and the collectives' buffers. Under mixed
precision the step computes in bf16 (`compute_dims`: no weight casts, a bf16 stream), the state and
the gradient reduction stay fp32. Measured equal to the byte (tests/test_theory_sharded.py) but for
what tpbench.predict.checked names, which compose refuses for kind=memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tpbench.config import RunConfig
from tpbench.predict.theory import blocks, recomputed
from tpbench.predict.theory.activations import after_head, layer_activations, model_activations
from tpbench.predict.theory.dims import FP32, LOSS_AND_GRAD, Dims, dims
from tpbench.predict.theory.moments import Moment, loss_forward
from tpbench.predict.theory.shards import (
    ROOT,
    dim0_shard,
    flat_shard,
    unit_of,
    unit_shards,
    units,
    zero_buckets,
)
from tpbench.predict.theory.weights import adam_temporaries, optimizer_bytes, param_bytes, params

LEVELS = ("none", "optimizer", "grads", "full")
GRADS, PARAMS = "dp_grads", "dp_params"  # the purposes of the DP collectives (DDP's is dp_grads too)


@dataclass(frozen=True)
class Sharding:
    """A config's DP sharding: its level, the shard group's size D and the replicas R (HSDP)."""

    level: str
    dp: int
    replicate: int = 1

    @property
    def D(self) -> int:  # noqa: N802
        return self.dp // self.replicate

    @property
    def sharded(self) -> bool:
        return self.level != "none" and self.D > 1

    @property
    def fsdp(self) -> bool:
        return self.level in ("grads", "full") and self.D > 1


def sharding(cfg: RunConfig) -> Sharding:
    p = cfg.parallel
    return Sharding(p.dp_shard, p.dp, p.dp_replicate)


# --- the state kept between steps -----------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """What one rank keeps of the model between steps, in bytes: the parameters (whole, or its shard:
    the master, which AdamW steps), the gradients (whole at the step, or the shard), AdamW's moments
    and its step counters."""

    params: int
    master: int  # of `params`, what AdamW steps on this rank
    grads: int
    moments: int
    steps: int

    @property
    def optimizer(self) -> int:
        return self.moments + self.steps


def state(d: Dims, s: Sharding) -> State:
    w = d.w
    counters = not (d.gpu and not d.fused_adam)  # a GPU's non-fused AdamW keeps them on the host
    whole = sum(n for _, n in params(d))
    if not s.sharded:
        return State(whole * w, whole * w, whole * w, 2 * whole * w, FP32 * len(params(d)) * counters)
    if s.level == "optimizer":  # the param buffer (bf16 under mixed) and, under mixed only, the fp32
        shard = flat_shard(d, s.D)  # master pieces, their own copies (pure: the buffer's own pieces)
        weights = shard * s.D * d.p + shard * w if d.mixed else shard * s.D * w
        pieces = len(zero_buckets(d, s.D))  # AdamW's step counter: one per bucket's piece
        return State(weights, shard * w, shard * s.D * w, 2 * shard * w, FP32 * pieces * counters)
    shard = sum(unit_shards(d, s.D).values())
    return State(shard * w, shard * w, shard * w, 2 * shard * w, FP32 * len(params(d)) * counters)


# --- the moments of the step ----------------------------------------------------------------------

FORWARD_ONLY = (  # before backward starts
    "loss forward", "attention forward", "attention dropout", "final norm forward", "head forward",
)  # fmt: skip
FORWARD = ("loss", "loss backward", *FORWARD_ONLY)
BLOCK_BACKWARD = (  # the unsharded step's moments in the top block's backward (recompute none)
    "down_proj backward", "swiglu backward", "post-attention norm backward", "k_norm backward",
    "q_norm backward", "mlp backward", "mlp entry backward", "attention",
)  # fmt: skip
ROOT_BACKWARD = ("head backward", "head weight cast's backward", "final norm backward")
AFTER_BLOCKS = ("backward end", "embedding backward")


def moments(d: Dims, s: Sharding, base: list[Moment], accumulating: bool = False) -> list[Moment]:
    """The step's moments under a sharded level, from the unsharded model's (`base`, made without
    DDP's buckets or megatron's flat ones): their activations and temporaries as they are, the
    parameter, gradient and optimizer bytes the level's, the gathered weights (FSDP2) and the
    gradients' reduce-scatter. `accumulating` (FSDP2, train.accumulation's later micro-batches,
    tpbench.predict.theory.accumulation): every unit's sharded gradients are held from the start, each
    reduce-scatter's output a temporary added into them (FSDP2's foreach_reduce), not the shard."""
    st, w = state(d, s), d.w
    if s.level == "optimizer":
        return _zero1(d, s, st, base)
    D, L, c = s.D, d.L, computing(d, s)
    blocks = [f"layers.{i}" for i in range(L)]
    shard_g = {u: n * w for u, n in unit_shards(d, D).items()}
    gathered = {u: D * n * c.w for u, n in unit_shards(d, D).items()}  # in the compute dtype
    rs_in = {u: D * n for u, n in shard_g.items()}  # a reduce-scatter's input, in w's dtype (fp32)
    whole = {u: 0 for u in shard_g}  # each unit's gradients whole, as backward makes them
    for name, n in params(d):
        whole[unit_of(name)] += n * c.w
    out = []
    for m in _forward_moments(c, base) + _lower_blocks(c, s, base, whole) + _middle_blocks(c, s):
        if m.name in ("gradient sums", "gradient clipping", "optimizer"):
            continue
        held = [ROOT]  # gathered units MemTracker counts as parameters: in forward, or the running one
        fetched: list[str] = []  # prefetched in backward: temporaries to MemTracker
        done: list[str] = []  # units whose backward ran: their gradients reduce-scattered into shards
        layer = L - 1
        kind, _, at = m.name.rpartition(" ")
        if at.isdigit() and (kind.startswith("recomputed ") or kind in BLOCK_BACKWARD):  # in block `at`
            layer = int(at)
        in_forward = m.name in FORWARD_ONLY or (m.name == "loss" and d.vp and not d.logits_mean)
        if m.name in AFTER_BLOCKS:
            done = blocks
        elif m.name not in FORWARD and m.name not in ROOT_BACKWARD:
            done = blocks[layer + 1 :]
        if s.level == "grads":  # every block gathered from forward until its own backward ends
            held += [b for b in blocks if b not in done]
        elif m.name in ("attention forward", "attention dropout"):
            held.append(blocks[-1])
        elif not in_forward and (m.name in FORWARD or m.name in ROOT_BACKWARD):
            fetched.append(blocks[-1])  # the root's pre-backward prefetches the top block
        elif m.name not in FORWARD and m.name not in AFTER_BLOCKS:  # block `layer`, the next prefetched
            held.append(blocks[layer])
            fetched += blocks[max(layer - 1, 0) : layer]
        weights = st.params + sum(gathered[u] for u in held)
        temps = m.temporaries + sum(gathered[u] for u in fetched)
        # FSDP2 keeps the last forward all-gather's flat output, the top block's, until the root's
        # post-forward (its all_gather_state): alive in the top block's forward and the loss's
        acts = m.activations + (flat := gathered[blocks[-1]] if in_forward else 0)
        if done:  # FSDP2 keeps the last reduce-scatter's input until the next one (its reduce_scatter_state)
            temps += rs_in[done[0]]
        # the base counts the gradients made so far whole: the done blocks' are shards now
        made = m.grads - sum(whole[u] for u in done)
        grads = made + (st.grads if accumulating else sum(shard_g[u] for u in done))
        out.append(replace(m, params=weights, grads=grads, optimizer=st.optimizer, activations=acts,
                           temporaries=temps,
                           streams=grads - made + flat + sum(gathered[u] for u in fetched)))  # fmt: skip
    top = _top_block_gather(c, s, st, gathered)
    out.insert(0, replace(top, grads=st.grads) if accumulating else top)
    extra = []
    for i in sorted({L - 1, 0}) if s.fsdp else []:
        extra.append(_block_reduce_scatter(c, s, st, gathered, rs_in, shard_g, i))
    if s.level == "full" and L > 1 and d.recompute not in ("full", "op"):
        extra.append(_next_block_gather(c, st, gathered, rs_in, shard_g))
    extra.append(_bottom_input_norm_backward(c, st, base[-1].activations, gathered, rs_in, shard_g, whole))
    out += [_accumulating(c, st, shard_g, m) for m in extra] if accumulating else extra
    kept = base[-1].activations
    # the root's gradients reduce-scattered at backward's end: copied into a padded input (fp32 under
    # mixed precision), freed once copied (FSDP2's foreach_reduce), then the output made beside the
    # input
    root_in, rs_out = rs_in[ROOT], shard_g[ROOT]
    sharded_blocks = st.grads if accumulating else sum(shard_g[b] for b in blocks)  # the root's too
    out.append(Moment("root reduce-scatter copy-in", st.params, sharded_blocks + whole[ROOT], st.optimizer,
                      kept, root_in, sharded_blocks))  # fmt: skip
    out.append(Moment("root reduce-scatter", st.params, sharded_blocks, st.optimizer, kept, root_in + rs_out,
                      sharded_blocks + rs_out))  # fmt: skip
    clipping = [m for m in base if m.name == "gradient clipping"]  # train.grad_clip: the sharded gradients
    out += [
        Moment(m.name, st.params, st.grads, st.optimizer, kept, m.temporaries, st.grads) for m in clipping
    ]
    out.append(
        Moment("optimizer", st.params, st.grads, st.optimizer, kept, _adam_temporaries(d, s), st.grads)
    )
    return out


def _accumulating(d: Dims, st: State, shard_g: dict[str, int], m: Moment) -> Moment:
    """A moment of `_block_reduce_scatter`, `_next_block_gather` or `_bottom_input_norm_backward`
    in an accumulating micro-batch: every unit's shard held (st.grads) in place of the done blocks'
    shards, beside the whole gradients made so far (the root's own, block 0's)."""
    blocks = [f"layers.{i}" for i in range(d.L)]
    if m.name.startswith("block reduce-scatter "):
        done = blocks[int(m.name.rpartition(" ")[2]) + 1 :]
    else:
        done = blocks[-1:] if m.name == "next block all-gather" else blocks[1:]  # input norm backward 0
    shards = sum(shard_g[b] for b in done)
    return replace(m, grads=m.grads - shards + st.grads, streams=m.streams - shards + st.grads)


def _forward_moments(d: Dims, base: list[Moment]) -> list[Moment]:
    """The base moments with three of the forward's after the blocks, which the unsharded step leaves
    out (a moment of its backward holds what each holds and more): the final RMSNorm's last op, the
    LM head's matmul under SP and VP with the re-gather (its gathered input, not saved, beside the
    logits it makes) and the cross entropy's forward (`moments.loss_forward`: the logits, log_softmax's
    output, the targets). Under FSDP2 the top block's flat all-gather output is alive at each (the
    root's forward runs them), which lifts them above backward's: the cross entropy's forward is
    ZeRO-2's peak at the default tiny shape in fp32 (every block gathered, log_softmax's output a
    third of the activations), the final norm's in bf16 with VP. The vocab-parallel loss's forward is
    its "loss" already; the seed's logits mean runs after the root's forward."""
    acts = model_activations(d)
    whole = sum(acts.values())
    extra = [Moment("final norm forward", 0, 0, 0, whole + _final_norm_forward(d, acts), 0)]
    if d.sp and d.vp and d.regather:
        extra.append(Moment("head forward", 0, 0, 0, whole + d.s * d.N * d.H + d.p * d.N * d.V_l, 0))
    if not d.vp and not d.logits_mean:
        extra.append(Moment("loss forward", 0, 0, 0, whole + loss_forward(d), 0))
    at = next(i for i, m in enumerate(base) if m.name == "loss") + 1
    return [*base[:at], *extra, *base[at:]]


def _final_norm_forward(d: Dims, acts: dict[str, int]) -> int:
    """The final RMSNorm at its last op, `(weight * normed).type_as(x)`, beyond the saved activations
    less the head's input and weight cast (not made yet): the fp32 product and its cast to the
    stream's dtype (none where that is fp32: the product itself); a lean norm (its input kept alone,
    tpbench.models.minimind.RMSNorm) holds its fp32 copy of the input (unless that is fp32: x.float()
    is x) and the normed tensor too, which it does not save.
    model.fused_ops: torch's F.rms_norm, whose ops on a CPU are MiniMind's in one C++ function: the
    tracker sees its peak at the weight's mul (the fp32 product), with the rsqrt of each row still
    held (fp32 [Ns]) where the norm does not save it (lean); its cast back is seen with the product and
    the normed tensor already freed."""
    tokens = d.Ns * d.H
    fused = d.fused_ops and d.s == d.w  # F.rms_norm where the input's dtype is the weight's
    made = FP32 * tokens + (d.s * tokens if d.s != FP32 and not fused else 0)
    if d.lean_rmsnorm:
        made += FP32 * tokens + (FP32 * tokens if d.s != FP32 else 0) + (FP32 * d.Ns if fused else 0)
    return made - acts["head input"] - acts["head weight cast"]


def _lower_blocks(d: Dims, s: Sharding, base: list[Moment], whole: dict[str, int]) -> list[Moment]:
    """FSDP2 without full recompute: the top block's backward moments (`BLOCK_BACKWARD`) again in a
    lower block, named with its layer, as the unsharded step would count them there: the saved
    activations of the blocks above freed, their gradients whole (`moments` makes them shards, and
    adds the last reduce-scatter's input, kept: fp32 under mixed precision). Block 0 (ZeRO-2: the
    blocks above resharded, their activations gone) and, for ZeRO-3 from L 3, block 1 (block 0
    prefetched beside the reduce-scatter input): the rest of each moment is affine in the layer, so
    these and the top block are the candidates. Few tokens beside the reduce-scatter input make the
    bottom block's the peak (ZeRO-2 under mixed precision with VP at the default tiny shape)."""
    if d.recompute in ("full", "op") or d.L < 2:
        return []
    per_block = model_activations(d)["blocks"] // d.L
    out = []
    for layer in sorted({0, 1 if s.level == "full" and d.L >= 3 else 0}):
        above = range(layer + 1, d.L)
        grads = sum(whole[f"layers.{i}"] for i in above)
        out += [
            replace(m, name=f"{m.name} {layer}", grads=m.grads + grads,
                    activations=m.activations - len(above) * per_block)
            for m in base if m.name in BLOCK_BACKWARD
        ]  # fmt: skip
    return out


def _middle_blocks(d: Dims, s: Sharding) -> list[Moment]:
    """FSDP2 under full recompute, L >= 3: the recomputed moments of the blocks between the top and the
    bottom one (the unsharded step has those two only), as the unsharded model counts them. A middle
    block alone has both FSDP2's buffers at its backward: the block below prefetched, the block
    above's reduce-scatter input kept; both are the same for every middle block, and the rest of each
    moment is affine in the layer, so the lowest and the highest middle block are the candidates."""
    if d.recompute not in ("full", "op") or not s.fsdp or d.L < 3:
        return []
    acts, P, O = model_activations(d), param_bytes(d), optimizer_bytes(d)  # noqa: E741
    out = []
    for i in sorted({1, d.L - 2}):
        args = (d, acts, P, O, 0, True, i)
        out += [recomputed.recomputed_swiglu(*args), recomputed.recomputed_block(*args)]
        out.append(recomputed.recomputed_post_attention_norm(*args))
        if not d.flash:
            out += [blocks.attention_backward(*args), recomputed.recomputed_softmax(*args)]
            if d.dropout:
                out.append(recomputed.recomputed_attention_dropout(*args))
    return out


def _top_block_gather(d: Dims, s: Sharding, st: State, gathered: dict[str, int]) -> Moment:
    """The top block's all-gather in forward, at its copy-out: FSDP2 keeps the previous unit's flat
    all-gather output until the copy-out returns (its `all_gather_state`, held by a local there), so
    the previous unit's flat output, this block's and its unsharded parameters are alive at once,
    all allocated in forward (activations, to MemTracker), beside what the blocks below saved and the
    stream entering the block. The root and (ZeRO-2) the blocks below stay gathered."""
    acts = model_activations(d)
    below = sum(acts[k] for k in ("batch", "rope tables", "embedding", "embedding dropout"))
    below += acts["blocks"] // d.L * (d.L - 1) + d.s * d.Ns * d.H
    top, previous = f"layers.{d.L - 1}", f"layers.{d.L - 2}" if d.L > 1 else ROOT
    params = st.params + gathered[ROOT]
    if s.level == "grads":
        params += sum(gathered[f"layers.{i}"] for i in range(d.L - 1))
    buffers = gathered[previous] + 2 * gathered[top]
    flats = gathered[previous] + gathered[top]  # on FSDP2's copy-in stream (`Moment.streams`)
    return Moment("top block all-gather", params, 0, st.optimizer, below + buffers, 0, flats)


def _next_block_gather(
    d: Dims, st: State, gathered: dict[str, int], rs_in: dict[str, int], shard_g: dict[str, int]
) -> Moment:
    """ZeRO-3: the block below the top one at its pre-backward copy-out. The top block's backward has
    ended: its gradients are a shard, its reduce-scatter's input kept (to the next reduce-scatter), its
    weights and saved tensors freed. The block prefetched during it gets its unsharded parameters
    (parameters to MemTracker) beside the flat all-gather output (a temporary); the stream's gradient
    and a tied head's, waiting for the embedding's share, are alive too."""
    acts = model_activations(d)
    below, top = f"layers.{d.L - 2}", f"layers.{d.L - 1}"
    activations = after_head(acts) - acts["blocks"] // d.L + LOSS_AND_GRAD
    temps = gathered[below] + rs_in[top] + d.s * d.Ns * d.H + (d.V_l * d.H * d.w if d.tied else 0)
    root_grads = _root_grads(d)
    params = st.params + gathered[ROOT] + gathered[below]
    grads = shard_g[top] + root_grads
    streams = shard_g[top] + gathered[below]
    return Moment("next block all-gather", params, grads, st.optimizer, activations, temps, streams)


def _root_grads(d: Dims) -> int:
    """The root's own gradients once the blocks' backward has begun: the final norm's and an untied
    head's (a tied head's waits, a temporary, for the embedding's share)."""
    return (d.H + (0 if d.tied else d.V_l * d.H)) * d.w


def _block_reduce_scatter(
    d: Dims, s: Sharding, st: State, gathered: dict[str, int], rs_in: dict[str, int],
    shard_g: dict[str, int], layer: int,
) -> Moment:  # fmt: skip
    """FSDP2: block `layer`'s gradients reduce-scattered in its post-backward. The block is resharded
    and its gradients copied into the reduce-scatter's input (fp32 under mixed precision), the
    previous one's freed; the output, the shard, is made beside it (gloo's own clone of the input,
    on real CPU ranks, is of a staging copy no tracker counts: collectives._launch). The blocks above
    are done (their gradients shards), the root's own made, a tied head's waiting (a temporary) for
    the embedding's share; alive too: the block's input gradient, what the blocks below saved, the block below
    prefetched (ZeRO-3) or every block below still gathered (ZeRO-2)."""
    blocks = [f"layers.{i}" for i in range(d.L)]
    unit = blocks[layer]
    params = st.params + gathered[ROOT]
    temps = rs_in[unit] + shard_g[unit] + d.s * d.Ns * d.H
    prefetched = 0
    if s.level == "grads":
        params += sum(gathered[b] for b in blocks[:layer])
    elif layer > 0:
        prefetched = gathered[blocks[layer - 1]]
        temps += prefetched
    temps += d.V_l * d.H * d.w if d.tied else 0
    root_grads = _root_grads(d)
    # the block's input norm's weight gradient is made after the hook runs, still autograd's own
    done = sum(shard_g[b] for b in blocks[layer + 1 :])
    grads = done + root_grads + d.H * d.w
    acts = model_activations(d)
    activations = after_head(acts) - acts["blocks"] // d.L * (d.L - layer) + LOSS_AND_GRAD
    streams = done + shard_g[unit] + prefetched  # the output is made on the reduce-scatter stream too
    return Moment(f"block reduce-scatter {layer}", params, grads, st.optimizer, activations, temps, streams)


def _bottom_input_norm_backward(
    d: Dims,
    st: State,
    kept: int,
    gathered: dict[str, int],
    rs_in: dict[str, int],
    shard_g: dict[str, int],
    whole: dict[str, int],
) -> Moment:
    """FSDP2: block 0's input RMSNorm backward, the last op of the blocks' backward, at pow's backward.
    Every block above has run its backward: its gradients are a shard, the last one's reduce-scatter
    input (block 1's, fp32 under mixed precision) kept to the next reduce-scatter; block 0's gradients
    are all made, whole (its norm's weight gradient before pow's), beside the root's own (the final
    norm's, an untied head's; a tied head's waits, a temporary, for the embedding's share). Block 0 and
    the root are gathered. Alive: the norm's saved input (the block's input, the stream's dtype; the
    fp32 copy of MiniMind's own norm) beside what outlives backward, its fp32 temporaries (as
    `blocks.post_attention_norm_backward`: a sixth, the fp32 input made again, where the stream is not
    fp32) and the block's output gradient [Ns, H], waiting for the residual sum. Few tokens beside the
    fp32 reduce-scatter input make it the peak (ZeRO-2, mixed, S 4)."""
    blocks = [f"layers.{i}" for i in range(d.L)]
    params = st.params + gathered[ROOT] + gathered[blocks[0]]
    root_grads = _root_grads(d)
    done = sum(shard_g[b] for b in blocks[1:])
    grads = done + whole[blocks[0]] + root_grads
    saved = (d.s if d.lean_rmsnorm else FP32) * d.Ns * d.H
    if d.recompute == "full":  # what the checkpoint saved: the block's input, FSDP2's cast cos and sin
        saved = sum(layer_activations(d).values())
    elif d.recompute == "op":  # the same; what its policy kept is let go once the block is recomputed
        own = layer_activations(d)
        saved = own["block input"] + own["rope tables"]
    norm = (6 if d.lean_rmsnorm and d.s != FP32 else 5) * FP32 * d.Ns * d.H
    temps = (rs_in[blocks[1]] if d.L > 1 else 0) + norm + d.s * d.Ns * d.H
    temps += d.V_l * d.H * d.w if d.tied else 0
    activations = kept + LOSS_AND_GRAD - FP32 + saved  # the loss's gradient too
    return Moment("input norm backward 0", params, grads, st.optimizer, activations, temps, done)


def _zero1(d: Dims, s: Sharding, st: State, base: list[Moment]) -> list[Moment]:
    """ZeRO-1 (tpbench.parallel.zero): the parameter and gradient buffers persist (`.grad` the grad
    buffer's views where the dtypes agree), so backward's gradients are not its own. Every bucket's
    collective is in place, as Megatron's: a reduce-scatter in flight during backward writes this
    rank's piece of the grad buffer, the pieces are the masters' `.grad` at AdamW's step, an
    all-gather in flight beside the next forward writes the param buffer (mixed: each fp32 master
    piece copied into its bf16 piece first, in place). So buckets in flight hold nothing beside the
    buffers, and every moment holds the state as it is between steps."""
    out = []
    for m in base:
        if m.name == "gradient sums":
            continue
        temps = _adam_temporaries(d, s) if m.name == "optimizer" else m.temporaries
        out.append(replace(m, params=st.params, grads=st.grads, optimizer=st.optimizer, temporaries=temps))
    return out


def _adam_temporaries(d: Dims, s: Sharding) -> int:
    """AdamW's temporaries on the shards (tpbench.predict.theory.weights.adam_temporaries, group by
    group): ZeRO-1's pieces, one per bucket in bucket order, in one group (its decay groups are spans
    of them: tpbench.parallel.zero), FSDP2's shard of each parameter, unit by unit."""
    if s.level == "optimizer":
        pieces = [(f"bucket {i}", n // s.D) for i, (n, _) in enumerate(zero_buckets(d, s.D))]
        return adam_temporaries(replace(d, no_decay=()), pieces)
    return adam_temporaries(d, [(n, dim0_shard(r, c, s.D)) for u in units(d).values() for n, r, c in u])


def crossing(cfg: RunConfig) -> dict[str, bool]:
    """Which DP groups of rank 0 span nodes ("shard", "replicate"): the ranks are tp-major within a
    DP index, the shard group the inner DP dimension (FSDP2's (replicate, shard) mesh)."""
    s, T = sharding(cfg), cfg.parallel.tp
    per_node = cfg.launch.nproc_per_node or T * s.dp // int(cfg.launch.nnodes)

    def spans(dp_indices: range) -> bool:
        return len({i * T // per_node for i in dp_indices}) > 1

    return {"shard": spans(range(s.D)), "replicate": spans(range(0, s.dp, s.D))}


def split(d: Dims, s: Sharding, peak: Moment) -> dict[str, int]:
    """The peak of a level by what holds it, in bytes: the weights (the parameters whole or their
    shard, with FSDP's gathered blocks), of which the master AdamW steps, the gradients, AdamW's
    moments (and step counters), the activations and the temporaries."""
    return {
        "weights": peak.params,
        "master": state(d, s).master,
        "gradients": peak.grads,
        "moments": peak.optimizer,
        "activations": peak.activations,
        "temporaries": peak.temporaries,
    }


def computing(d: Dims, s: Sharding) -> Dims:
    """`compute_dims` from a sharded level's state Dims. FSDP2's MixedPrecisionPolicy casts a block's
    floating-point inputs to its param_dtype: the fp32 cos and sin tables once, for q and k both."""
    if not d.mixed:
        return d
    return replace(d, mixed=False, w=d.p, rope_cast_once=s.fsdp)


def level_dims(cfg: RunConfig) -> Dims:
    """The Dims of a sharded level's state: the model without DDP's or megatron's buckets."""
    return replace(dims(cfg), ddp=False, overlap=False)


def compute_dims(cfg: RunConfig) -> Dims:
    """The Dims a sharded level's step computes with, its moments' start. Under mixed precision the
    model's weights are in the autocast dtype (ZeRO-1's param buffer; FSDP2's gathered parameters,
    its MixedPrecisionPolicy's param_dtype), as in Megatron's distributed optimizer (bf16 parameters,
    fp32 main gradients and master shard): autocast casts no weight, the embedding's output and so the
    residual stream are bf16, and backward's gradients too. Its activations and temporaries are pure
    precision's in that dtype; the fp32 state is the level's (`state`)."""
    d = level_dims(cfg)
    s = sharding(cfg)
    return computing(d, s) if s.sharded else d
