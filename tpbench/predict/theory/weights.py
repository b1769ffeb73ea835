"""Weights, their gradients and AdamW's state on one rank: each parameter's elements in module order,
the order backward finishes their gradients (DDP's buckets follow it), and the bytes of each.

Shapes are [out, in] per linear on this rank: q_proj [Nq D / T, H], k_proj and v_proj [Nkv D / T, H]
(one replicated KV head when T does not divide Nkv), o_proj [H, Nq D / T], gate_proj and up_proj
[I / T, H], down_proj [H, I / T]; the norms' weights [H] (q_norm, k_norm [D]); the embedding and the
LM head [V / T, H] under VP, else [V, H].
"""

from __future__ import annotations

import functools

from tpbench.models.param_kinds import kind_of
from tpbench.predict.theory.dims import FP32, Dims


def layer_params(d: Dims) -> list[tuple[str, int]]:
    """(name, elements on this rank) of one block, in module order: a linear's weight under the
    linear's name, its bias (model.attention_bias: q, k, v) as `name.bias` after it."""
    H, D = d.H, d.D
    out = []
    for name, width in (("q_proj", d.Hq), ("k_proj", d.Hkv), ("v_proj", d.Hkv)):
        out.append((f"self_attn.{name}", width * H))
        if d.bias:
            out.append((f"self_attn.{name}.bias", width))
    out.append(("self_attn.o_proj", H * d.Hq))
    if d.qk_norm:
        out += [("self_attn.q_norm", D), ("self_attn.k_norm", D)]
    return out + [
        ("mlp.gate_proj", d.I_l * H),
        ("mlp.up_proj", d.I_l * H),
        ("mlp.down_proj", H * d.I_l),
        ("input_layernorm", H),
        ("post_attention_layernorm", H),
    ]


@functools.lru_cache(maxsize=64)
def params(d: Dims) -> tuple[tuple[str, int], ...]:
    """(name, elements on this rank) of every parameter, in module order; a tied head appears once.
    Cached (a Dims is frozen; `fit` asks for a deep model's thousands of times)."""
    out = [("model.embed_tokens", d.V_l * d.H)]
    layer = layer_params(d)
    for i in range(d.L):
        out += [(f"model.layers.{i}.{name}", n) for name, n in layer]
    out.append(("model.norm", d.H))
    if not d.tied:
        out.append(("lm_head", d.V_l * d.H))
    return tuple(out)


def grad_ready_order(d: Dims) -> list[tuple[str, int]]:
    """The order in which backward finishes the gradients (DDP rebuilds its buckets in it): the head,
    the final norm, then each block from the last, MLP before attention, and the (tied) embedding
    last, since its gradient is complete only after the embedding's own backward. A linear's bias
    is ready before its weight (the weight's gradient goes through the transpose's backward first)."""
    by_name = dict(params(d))
    order = ([] if d.tied else ["lm_head"]) + ["model.norm"]
    block = [
        "mlp.down_proj",
        "mlp.up_proj",
        "mlp.gate_proj",
        "post_attention_layernorm",
        "self_attn.o_proj",
        "self_attn.v_proj.bias",
        "self_attn.v_proj",
        "self_attn.k_norm",
        "self_attn.k_proj.bias",
        "self_attn.k_proj",
        "self_attn.q_norm",
        "self_attn.q_proj.bias",
        "self_attn.q_proj",
        "input_layernorm",
    ]
    for i in reversed(range(d.L)):
        order += [f"model.layers.{i}.{name}" for name in block]
    order.append("model.embed_tokens")
    return [(name, by_name[name]) for name in order if name in by_name]


def ddp_buckets(d: Dims, cap_bytes: int, rebuilt: bool = True) -> list[int]:
    """Bytes of each DDP gradient bucket. Without find_unused_parameters, DDP starts with one bucket
    and, after the first backward, rebuilds them in gradient-ready order, closing a bucket as soon
    as it reaches the cap (torch's compute_bucket_assignment_by_size; tpbench passes bucket_cap_mb,
    so the first bucket's cap is the same as the others')."""
    sizes = [n * d.w for _, n in grad_ready_order(d)]
    if not rebuilt:
        return [sum(sizes)]
    buckets, current = [], 0
    for size in sizes:
        current += size
        if current >= cap_bytes:
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


def late_params(d: Dims) -> set[str]:
    """Parameters whose DP sum waits for their TP gradient sum (q/k norms, SP's norms, KV replicas),
    and the tied embedding, which gets gradients from two places: the last of megatron's flat DP
    buckets (tpbench.parallel.overlap.DPGradBuckets)."""
    late = {"model.embed_tokens"} if d.tied else set()
    kv_replicas = d.Nkv % d.T != 0
    for name, _ in params(d):
        if d.T == 1 or not name.startswith("model.layers") and name != "model.norm":
            continue
        sums = ("q_norm", "k_norm") if d.qk_norm else ()
        sums += ("input_layernorm", "post_attention_layernorm", "model.norm") if d.sp else ()
        sums += ("k_proj", "v_proj", "k_proj.bias", "v_proj.bias") if kv_replicas else ()
        if name.endswith(sums):
            late.add(name)
    return late


def flat_dp_buckets(d: Dims, cap_bytes: float) -> list[int]:
    """Bytes of each of megatron's flat DP buckets under overlap (DPGradBuckets): the other
    parameters in reverse module order, a bucket closed before one that would take it past the cap,
    then the late ones in one (every parameter has one dtype here)."""
    late = late_params(d)
    buckets, size = [], cap_bytes + 1
    for name, n in reversed(params(d)):
        if name in late:
            continue
        if size + n * d.w > cap_bytes and size > 0:
            buckets.append(0)
            size = 0
        buckets[-1] += n * d.w
        size += n * d.w
    tail = sum(n for name, n in params(d) if name in late) * d.w
    return buckets + ([tail] if tail else [])


def block_linears(d: Dims) -> int:
    """Elements of one block's linear weights on this rank (their biases left out)."""
    return sum(n for name, n in layer_params(d) if not name.endswith(("norm", ".bias")))


# --- the bytes of each ----------------------------------------------------------------------------


def param_bytes(d: Dims) -> int:
    """The parameters on this rank, in the parameter dtype (fp32 masters under mixed precision)."""
    return sum(n for _, n in params(d)) * d.w


def optimizer_bytes(d: Dims) -> int:
    """AdamW's state: exp_avg and exp_avg_sq like the parameters, plus a 4-byte `step` per tensor on
    the parameters' device (a GPU's non-fused AdamW keeps it on the host)."""
    return 2 * param_bytes(d) + (0 if d.gpu and not d.fused_adam else FP32 * len(params(d)))


def bucket_bytes(d: Dims) -> int:
    """DDP's gradient buckets, alive from its construction on; likewise megatron's flat DP buckets
    under overlap (`Dims.flat_dp`), made at the first forward and kept for good."""
    return param_bytes(d) if d.ddp or d.flat_dp else 0


def grad_bytes(d: Dims) -> int:
    """The gradients backward makes: none of its own under DDP's gradient_as_bucket_view, which makes
    them views of the buckets, nor under megatron's flat DP buckets (`Dims.flat_dp`), which copy each
    gradient into its slot as it is ready and make `.grad` the slot's view."""
    return param_bytes(d) if not (d.ddp and d.bucket_view) and not d.flat_dp else 0


def late_grad_bytes(d: Dims) -> int:
    """Under megatron's flat DP buckets (`Dims.flat_dp`), the gradients that stay autograd's own to the
    end of backward: the late ones (`late_params`), copied into their slots only at the step's
    gradient sums; the tied embedding's is its moment's own."""
    if not d.flat_dp:
        return 0
    late = late_params(d) - {"model.embed_tokens"}
    return sum(n for name, n in params(d) if name in late) * d.w


def redistributed_grad_bytes(d: Dims) -> int:
    """The dtensor engine's gradients that finish_grads replaces with DTensor.redistribute's output
    (tpbench.parallel.dtensor): the Partial ones of replicated weights that see a shard of their
    input (q/k norms; the block and final norms under SP), and under VP the embedding's, which
    DTensor makes Replicate over the whole vocab and finish_grads slices to this rank's rows."""
    if not d.dtensor:
        return 0
    norms = [n for name, n in params(d) if name.endswith(("q_norm", "k_norm"))]
    if d.sp:
        norms += [n for name, n in params(d) if name.endswith("layernorm") or name == "model.norm"]
    return (sum(norms) + (d.V_l * d.H if d.vp else 0)) * d.w


def optimizer_temporaries(d: Dims) -> int:
    """AdamW's temporaries at its step, over this rank's parameters (`params`): `adam_temporaries`."""
    return adam_temporaries(d, params(d))


def adam_temporaries(d: Dims, tensors: list[tuple[str, int]]) -> int:
    """AdamW's temporaries at its step over `tensors` (name, elements), group by group (`adam_groups`).
    On the CPU it runs one tensor at a time, in each group's order: a tensor's sqrt(exp_avg_sq) and its
    quotient by the bias correction live together beside the previous tensor's `denom`, which the
    loop's variable holds until the new one is assigned (a group's first has none: the previous
    group's loop has returned); foreach (GPU) makes them for a whole group at once; the fused kernel
    updates each element in place and makes none."""
    if d.fused_adam:
        return 0
    groups = [[n for _, n in group] for group in adam_groups(d, tensors)]
    if d.gpu:
        return max(sum(sizes) for sizes in groups) * d.w
    single = (max(2 * n + b for n, b in zip(s, [0] + s[:-1], strict=True)) for s in groups)
    return max(single) * d.w


def adam_groups(d: Dims, tensors: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """`tensors` as AdamW steps them (tpbench.experiments.optim.param_groups): the decayed ones, then
    those train.no_decay leaves undecayed, each in the given order; one group without such groups."""
    if not d.no_decay:
        return dtensor_split(d, tensors)
    full = lambda name: name if name.endswith(".bias") else f"{name}.weight"  # noqa: E731
    off = [t for t in tensors if kind_of(full(t[0])) in d.no_decay]
    on = [t for t in tensors if kind_of(full(t[0])) not in d.no_decay]
    return [g for group in (on, off) if group for g in dtensor_split(d, group)]


def dtensor_split(d: Dims, group: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """A group as AdamW steps it (tpbench.experiments.optim.by_kind): under the dtensor engine its plain
    tensors, then its DTensors, each in order; else as it is. Plain are the parameters no ParallelStyle
    takes: the block and final norms without SP, the embedding and LM head without VP."""
    if not d.dtensor:
        return [group]
    norm = lambda name: name.endswith("layernorm") or name == "model.norm"  # noqa: E731
    ends = ("model.embed_tokens", "lm_head")
    plain = [t for t in group if not d.sp and norm(t[0]) or not d.vp and t[0] in ends]
    return [g for g in (plain, [t for t in group if t not in plain]) if g]
