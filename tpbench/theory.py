"""The analytic model: per-rank memory and communication of one training step, for any config.

Memory is what torch's MemTracker sees on one rank: the bytes of live tensor storages. A step is
  zero_grad(set_to_none) -> forward -> loss -> backward -> gradient sums -> AdamW step,
so the peak is the largest of a few moments (`Prediction.moments`):
  loss          the cross entropy, every activation of the forward still saved for backward;
  head backward the LM head's backward: the logits' and the head weight's gradients;
  final norm backward  the final RMSNorm's backward: five fp32 [Ns, H] at once;
  mlp backward  the top layer's SwiGLU backward, at gate_proj's weight gradient;
  attention     the top layer's manual-attention backward, with its fp32 [B, N, S, S] gradients;
  backward end  a tied embedding's two gradients and their sum, beside all the others;
  gradient sums megatron with DP: every gradient and a flat copy of them all being all-reduced;
  optimizer     AdamW: parameters, gradients, both moments and its temporaries.
Communication is what tpbench.parallel.comm.CommCounter counts: per-rank ring bytes per step.

Notation (per rank, T = tp): S sequence, B sequences per DP rank, N = S*B tokens, H hidden, D head dim,
Nq / Nkv query / key-value heads, I intermediate, V vocab (padded under VP), L layers.
Ns = N/T tokens of the residual stream under SP (N without). p bytes of an activation element,
w of a parameter element; 4 for the fp32 in which RMSNorm, softmax and the loss compute.

Saved activations per layer, bf16 (p = 2), bytes, T = 1, SDPA, GQA (Nkv < Nq):
  2 RMSNorms        2 (4 + 4) N H           the fp32 copy of the input (pow and mul save it) and the
                                            fp32 normed tensor (the weight's mul saves it: MiniMind
                                            scales in fp32 and casts the product back)
  2 region inputs   2 * 2 N H               one tensor each, saved by q/k/v and by gate/up
  q/k norms         (4 + 4) N (H + Hkv)     the same RMSNorm over the head dim; Hkv = Nkv D
  q, k, v for SDPA  3 * 2 N H               rope(q); k and v copied by repeat_kv (expand + reshape)
                                            (a view when a rank holds a single KV head)
  SDPA out          2 N H + 4 B Nq S        viewed, not copied, as o_proj's input; + logsumexp
  SwiGLU            4 * 2 N I               gate out (silu), silu out and up out (mul), product (down)
= N H (36 + 8 Nkv/Nq + 8 I/H) bytes: 65.3 N H at heads 8/4 and I = 3.17 H, where the paper's GPT
layer (dropout, GeLU, 4H MLP) has 34 N H. RoPE saves only its cos/sin tables cast to p (they need
no grad; the fp32 tables are built once per device and kept: `model_activations`), the residual adds
save nothing. Manual attention adds the fp32 softmax and its cast: (4 + 2) B Nq S^2, the
paper's 5 a S / H term. TP divides the per-head and per-I terms by T, while the norms and the
region inputs stay whole on every rank; SP divides those too (the region inputs only with the
re-gather), so that TP + SP saves 1/T of everything, as in the paper.

Mixed precision (fp32 masters, autocast): the stream and the norms are fp32, and every autocast op
saves its own bf16 casts: q, k and v each cast the region input (3 copies, gate and up 2), and each
linear's weight is cast once per forward and kept until its backward. q/k norms cast back to their
input's dtype, the autocast dtype of q_proj's and k_proj's outputs, so RoPE and SDPA run in it.
SP's re-gather never triggers there: the linears save their casts, not the gathered input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpbench.allocator import CUBLAS_HANDLES, cublas_workspace_bytes
from tpbench.config import RunConfig, local_batch
from tpbench.models.minimind import default_intermediate_size
from tpbench.parallel.plan import padded_vocab
from tpbench.results import CommRow

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32, INT64 = 4, 8


@dataclass(frozen=True)
class Dims:
    """Every size the model needs, seen from one rank."""

    S: int
    B: int  # sequences per DP rank (its TP group shares them)
    H: int
    L: int
    Nq: int
    Nkv: int
    I: int  # noqa: E741
    V: int  # the real vocab
    Vp: int  # the vocab the embedding / LM head hold: padded to a multiple of T under VP
    T: int
    dp: int
    sp: bool
    vp: bool
    regather: bool
    flash: bool
    tied: bool
    p: int  # bytes of an activation element
    w: int  # bytes of a parameter, gradient or optimizer-state element
    mixed: bool
    ddp: bool
    bucket_view: bool
    gpu: bool
    logits_mean: bool  # the seed's benchmark loss, logits.float().mean(), instead of cross entropy

    @property
    def s(self) -> int:
        """Bytes of a residual-stream element: fp32 under mixed precision (the embedding is fp32 and
        adding a bf16 branch to it stays fp32), else the activation dtype."""
        return FP32 if self.mixed else self.p

    @property
    def D(self) -> int:
        return self.H // self.Nq

    @property
    def N(self) -> int:
        return self.S * self.B

    @property
    def Ns(self) -> int:
        """Tokens of the residual stream on this rank: SP keeps S/T of them."""
        return self.N // self.T if self.sp else self.N

    @property
    def Nq_l(self) -> int:
        return self.Nq // self.T

    @property
    def Nkv_l(self) -> int:
        """KV heads on this rank: sharded when T divides them, else one replicated head."""
        return self.Nkv // self.T if self.Nkv % self.T == 0 else 1

    @property
    def Hq(self) -> int:
        return self.Nq_l * self.D

    @property
    def Hkv(self) -> int:
        return self.Nkv_l * self.D

    @property
    def I_l(self) -> int:
        return self.I // self.T

    @property
    def V_l(self) -> int:
        return self.Vp // self.T if self.vp else self.V

    @property
    def saved_input_tokens(self) -> int:
        """Tokens of a region's gathered input that stay saved: the shard under SP with re-gather."""
        return self.Ns if self.sp and self.regather else self.N


def dims(cfg: RunConfig) -> Dims:
    m, par, t = cfg.model, cfg.parallel, cfg.train
    T = par.tp
    vp = par.vp and T > 1
    mixed = t.precision == "mixed"
    return Dims(
        S=t.seq_len,
        B=local_batch(cfg),
        H=m.hidden_size,
        L=m.num_hidden_layers,
        Nq=m.num_attention_heads,
        Nkv=m.num_key_value_heads,
        I=m.intermediate_size or default_intermediate_size(m.hidden_size),
        V=m.vocab_size,
        Vp=padded_vocab(m.vocab_size, T, par.vocab_pad_multiple) if vp else m.vocab_size,
        T=T,
        dp=par.dp,
        sp=par.sp and T > 1,
        vp=vp,
        regather=par.sp_regather,
        flash=m.flash_attn,
        tied=m.tie_word_embeddings,
        p=BYTES[t.dtype],
        w=FP32 if mixed else BYTES[t.dtype],
        mixed=mixed,
        ddp=par.engine == "ddp",
        bucket_view=par.ddp_gradient_as_bucket_view,
        gpu=cfg.launch.device == "cuda",
        logits_mean=t.loss == "logits_mean",
    )


# --- parameters ---------------------------------------------------------------------------------


def layer_params(d: Dims) -> list[tuple[str, int]]:
    """(name, elements on this rank) of one block, in module order."""
    H, D = d.H, d.D
    return [
        ("self_attn.q_proj", d.Hq * H),
        ("self_attn.k_proj", d.Hkv * H),
        ("self_attn.v_proj", d.Hkv * H),
        ("self_attn.o_proj", H * d.Hq),
        ("self_attn.q_norm", D),
        ("self_attn.k_norm", D),
        ("mlp.gate_proj", d.I_l * H),
        ("mlp.up_proj", d.I_l * H),
        ("mlp.down_proj", H * d.I_l),
        ("input_layernorm", H),
        ("post_attention_layernorm", H),
    ]


def params(d: Dims) -> list[tuple[str, int]]:
    """(name, elements on this rank) of every parameter, in module order; a tied head appears once."""
    out = [("model.embed_tokens", d.V_l * d.H)]
    for i in range(d.L):
        out += [(f"model.layers.{i}.{name}", n) for name, n in layer_params(d)]
    out.append(("model.norm", d.H))
    if not d.tied:
        out.append(("lm_head", d.V_l * d.H))
    return out


def grad_ready_order(d: Dims) -> list[tuple[str, int]]:
    """The order in which backward finishes the gradients (DDP rebuilds its buckets in it): the head,
    the final norm, then each block from the last, MLP before attention, and the (tied) embedding
    last, since its gradient is complete only after the embedding's own backward."""
    by_name = dict(params(d))
    order = ([] if d.tied else ["lm_head"]) + ["model.norm"]
    block = [
        "mlp.down_proj",
        "mlp.up_proj",
        "mlp.gate_proj",
        "post_attention_layernorm",
        "self_attn.o_proj",
        "self_attn.v_proj",
        "self_attn.k_norm",
        "self_attn.k_proj",
        "self_attn.q_norm",
        "self_attn.q_proj",
        "input_layernorm",
    ]
    for i in reversed(range(d.L)):
        order += [f"model.layers.{i}.{name}" for name in block]
    order.append("model.embed_tokens")
    return [(name, by_name[name]) for name in order]


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


# --- activations --------------------------------------------------------------------------------


def layer_activations(d: Dims) -> dict[str, int]:
    """Bytes one block saves for backward on this rank, term by term.

    p is the activation dtype: train.dtype, or the autocast dtype under mixed precision, where the
    stream and the norms stay fp32 (d.s) and every autocast op saves its own bf16 casts: each of q, k,
    v (gate, up) casts the fp32 region input; the linears' weights are cast once per forward (and
    kept, saved, until their backward)."""
    N, Ns, S, B, H, p = d.N, d.Ns, d.S, d.B, d.H, d.p
    rmsnorm = 2 * FP32 * Ns * H + FP32 * Ns  # fp32 input, rsqrt [Ns, 1], fp32 normed (weight's mul)
    if d.mixed:  # the linears save their casts of the whole (gathered) input: 3 for attention, 2 MLP
        # (SP's re-gather then never triggers, but its unpack hook, kept with every tensor saved in
        # the region, holds on to the fp32 shard)
        shard = d.s * Ns * H if d.sp and d.regather else 0
        attn_input, mlp_input = 3 * p * N * H + shard, 2 * p * N * H + shard
    else:  # one tensor q/k/v (gate/up) share: under SP with the re-gather, only this rank's shard
        attn_input = mlp_input = p * d.saved_input_tokens * H
    k_width, v_width = kv_widths(d)
    if d.flash:  # SDPA saves its output (o_proj's input is a view of it) and the logsumexp
        core = p * N * d.Hq + FP32 * B * d.Nq_l * S
    else:  # fp32 softmax output, its cast (unless it is fp32 already), o_proj's input copy
        core = (FP32 + (p if p != FP32 else 0)) * B * d.Nq_l * S * S + p * N * d.Hq
    terms = {
        "input_layernorm": rmsnorm,
        "attention input": attn_input,
        "q_norm": 2 * FP32 * N * d.Hq + FP32 * N * d.Nq_l,
        "k_norm": 2 * FP32 * N * d.Hkv + FP32 * N * d.Nkv_l,
        "rope tables": 4 * S * d.D * p if p != FP32 else 0,  # cos, sin cast to p, for q and for k
        "q, k, v": p * N * (d.Hq + k_width + v_width),
        "attention core": core,
        "post_attention_layernorm": rmsnorm,
        "mlp input": mlp_input,
        "swiglu": 4 * p * N * d.I_l,
    }
    if d.mixed:
        linears = sum(n for name, n in layer_params(d) if not name.endswith("norm"))
        terms["weight casts"] = p * linears
    return terms


def kv_widths(d: Dims) -> tuple[int, int]:
    """Widths of the k and v that attention saves. repeat_kv's expand + reshape copies them out to the
    query heads, unless this rank has one KV head: then the expanded size-1 dim merges into a
    stride-0 view and nothing is copied. SDPA saves that view; manual attention's matmuls reshape it
    to [B Nq, S, D], which copies it (and saves the copy) unless B is 1 (a size-1 batch dim merges
    with the stride-0 head dim)."""
    n_rep = d.Nq_l > d.Nkv_l
    v_width = d.Hq if n_rep and (d.Nkv_l > 1 or not d.flash and d.B > 1) else d.Hkv
    return v_width, v_width


def model_activations(d: Dims) -> dict[str, int]:
    """Bytes saved for backward outside the blocks, and the tensors the step holds all along."""
    N, Ns, H, p = d.N, d.Ns, d.H, d.p
    if d.mixed:  # the LM head's cast of the whole input; with SP and VP, the unused shard too
        head_input = p * N * H + (d.s * Ns * H if d.sp and d.vp and d.regather else 0)
    else:
        head_input = p * (Ns if d.sp and d.vp and d.regather else N) * H
    return {
        "blocks": d.L * sum(layer_activations(d).values()),
        "embedding": embedding_activations(d),
        "rope tables": 2 * FP32 * d.S * d.D,  # cos, sin [S, D] fp32, built once and kept by the model
        "final norm": 2 * FP32 * Ns * H + FP32 * Ns + head_input,
        "head weight cast": p * d.V_l * H if d.mixed else 0,
        "logits": p * N * d.V_l,  # [S, B, V(/T)]; the training step keeps them until it returns
        "batch": 2 * INT64 * d.B * d.dp * d.S,  # ids and labels of the global batch (sliced views)
    }


def embedding_activations(d: Dims) -> int:
    """VP: the embedding saves its masked local ids (int64) and its out-of-range mask (bool).
    SP without VP: the stream's shard is a view (split along dim 0) of the whole embedding output; in
    fp32 the first RMSNorm saves that view as its input, so the whole [S, B, H] stays alive."""
    if d.vp:
        return (INT64 + 1) * d.N
    return d.s * (d.N - d.Ns) * d.H if d.sp and d.s == FP32 else 0


def loss_extra(d: Dims) -> tuple[int, int]:
    """(activation, temporary) bytes of the loss at its peak, beyond the logits.

    Dense loss (F.cross_entropy on logits.float()): the peak is log_softmax's backward, holding its
    fp32 output (saved), the fp32 gradient from nll_loss and the fp32 gradient it makes: 3 x 4 N V,
    and the loss and its gradient (4 B each).
    Vocab-parallel loss: the peak is its forward's log(sum exp) - target logit, holding the fp32 logits
    (a copy unless p is 4 and no padded column is masked), logits - max and their exp: up to
    3 x 4 N V/T, and [N] bookkeeping.
    The seed's logits.float().mean(): the fp32 copy of the logits (unless they are fp32), freed once
    the mean is taken; its backward is the logits' gradient of the head's backward."""
    nv = d.N * d.V_l
    if d.logits_mean:
        return (FP32 * nv if d.p != FP32 else 0), 0
    if not d.vp:
        return FP32 * nv + 2 * FP32, 2 * FP32 * nv
    padded = d.Vp > d.V  # the last rank masks its padded columns into a new tensor
    # [S, B] bookkeeping: targets and local ids (int64); row max, target logit, sum of exp, its log
    # and log - target (fp32); two masks (bool); the count of valid targets (an int64 scalar); on the
    # rank with padded columns, their mask [V/T] (bool)
    small = (2 * INT64 + 5 * FP32 + 2) * d.N + INT64 + (d.V_l if padded else 0)
    forward = (FP32 if d.p != FP32 or padded else 0) * nv + 2 * FP32 * nv + small
    backward_temp = FP32 * nv + (d.p * nv if d.p != FP32 else 0)  # softmax grad, its cast
    return (forward, 0) if forward >= FP32 * nv + backward_temp else (FP32 * nv, backward_temp)


# --- the peak -----------------------------------------------------------------------------------


@dataclass
class Moment:
    """The live bytes at one moment of the step, by MemTracker's categories."""

    name: str
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries


def moments(d: Dims) -> list[Moment]:
    sizes = [n for _, n in params(d)]
    P = sum(sizes) * d.w
    # AdamW: exp_avg and exp_avg_sq like the parameters, plus a 4-byte `step` per tensor (on the CPU)
    O = 2 * P + (0 if d.gpu else FP32 * len(sizes))  # noqa: E741
    # DDP's buckets live from construction; gradient_as_bucket_view makes the gradients views of them
    buckets = P if d.ddp else 0
    G = P if not (d.ddp and d.bucket_view) else 0  # gradients made in backward
    acts = model_activations(d)
    A = sum(acts.values())
    # what outlives the backward: the logits, the batch, the rope tables and the loss the step returns
    kept = acts["logits"] + acts["batch"] + acts["rope tables"] + FP32
    during = A + 2 * FP32  # in backward: every activation, the loss and its gradient (ones)

    loss_act, loss_temp = loss_extra(d)
    out = [Moment("loss", P, buckets, O, A + loss_act, loss_temp)]

    # the LM head's backward: the logits' gradient, the head's weight gradient (not yet accumulated
    # into .grad) and its input gradient, with every activation still saved
    temp = d.p * d.N * d.V_l + d.V_l * d.H * d.w + d.p * d.N * d.H
    if d.sp and d.vp and d.regather and not d.mixed:  # the head's input, all-gathered again
        temp += d.p * d.N * d.H
    out.append(Moment("head backward", P, buckets, O, during, temp))
    out.append(final_norm_backward(d, acts, during, P, O, buckets, G > 0))
    out.append(mlp_backward(d, acts, during, P, O, buckets, G > 0))
    if not d.flash:
        out.append(attention_backward(d, acts, during, P, O, buckets, G > 0))

    if d.tied:  # the LM head's gradient waits for the embedding's; the two are summed into a third
        E = d.V_l * d.H * d.w
        own = G - E if G else 0
        out.append(Moment("backward end", P, buckets + own, O, kept + FP32, 3 * E))
    if d.dp > 1 and not d.ddp:  # megatron's DP sum concatenates every gradient into one flat copy
        out.append(Moment("gradient sums", P, buckets + G, O, kept, P))
    # AdamW on the CPU runs one tensor at a time: sqrt(exp_avg_sq) and its quotient by the bias
    # correction live together for the largest tensor; foreach (GPU) makes them for all at once
    adam_temp = P if d.gpu else 2 * max(sizes) * d.w
    out.append(Moment("optimizer", P, buckets + G, O, kept, adam_temp))
    return out


def final_norm_backward(
    d: Dims, acts: dict[str, int], alive: int, P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The final RMSNorm's backward, at pow's backward: the gradient through rsqrt (x * rsqrt's share),
    mean's expanded gradient, x^1, 2 x^1 and their product, 5 fp32 [Ns, H] at once. By then the head
    has run its backward and the norm's rsqrt and normed output are freed; its fp32 input stays
    (pow saved it). A tied LM head's gradient waits, as a temporary, for the embedding's share."""
    fp32_input = FP32 * d.Ns * d.H
    freed = acts["final norm"] - fp32_input
    grads = d.H + (0 if d.tied else d.V_l * d.H)
    grads = buckets + (grads * d.w if own_grads else 0)
    tied_head = d.V_l * d.H * d.w if d.tied else 0
    temp = 5 * FP32 * d.Ns * d.H + tied_head
    return Moment("final norm backward", P, grads, optim, alive - freed, temp)


def mlp_backward(
    d: Dims, acts: dict[str, int], alive: int, P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The top block's SwiGLU backward, at gate_proj's weight gradient: the stream's gradient, silu's
    gradient [N, I/T], the input gradients of up and gate [N, H] each (summed once gate's backward
    ends) and the weight gradient being made; SP's re-gather of the saved input shard for gate. By
    then the head, the final norm (its input too), down and up have run their backward: their saved
    tensors (SwiGLU's four) are freed, down's and up's gradients made. A tied LM head's gradient
    waits, as a temporary. (Mixed precision: the casts that up's and down's backward free are taken
    off; no config measured here peaks at this moment under autocast.)"""
    layer = layer_activations(d)
    freed = acts["final norm"] + layer["swiglu"]
    if d.mixed:  # down's and up's weight casts, up's cast of the input
        freed += d.p * 2 * d.I_l * d.H + d.p * d.N * d.H
    done = ("mlp.down_proj", "mlp.up_proj")
    grads = d.H + sum(n for name, n in layer_params(d) if name in done) + (0 if d.tied else d.V_l * d.H)
    grads = buckets + (grads * d.w if own_grads else 0)
    temp = d.s * d.Ns * d.H + d.p * d.N * (d.I_l + 2 * d.H) + d.p * d.I_l * d.H
    if d.sp and d.regather and not d.mixed:
        temp += d.p * d.N * d.H
    temp += d.V_l * d.H * d.w if d.tied else 0
    return Moment("mlp backward", P, grads, optim, alive - freed, temp)


def attention_backward(
    d: Dims, acts: dict[str, int], alive: int, P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The top block's manual-attention backward, at softmax's backward: the fp32 softmax output
    (saved), the fp32 gradient of the probabilities and the fp32 result, 3 x 4 B Nq S^2 at once.
    By then the head, the final norm, the MLP and o_proj have run their backward: their saved
    tensors are freed and their gradients made. A tied LM head's gradient waits, as a temporary, for
    the embedding's share. Also alive: the residual stream's gradient and v's (its node runs later)."""
    layer = layer_activations(d)
    scores = d.B * d.Nq_l * d.S * d.S
    v_width = kv_widths(d)[1]
    freed = acts["final norm"] + layer["post_attention_layernorm"] + layer["mlp input"] + layer["swiglu"]
    freed += (d.p * scores if d.p != FP32 else 0) + d.p * d.N * (d.Hq + v_width)  # probs, o in, v
    done = ["mlp.", "post_attention_layernorm", "self_attn.o_proj"]
    grads = d.H + sum(n for name, n in layer_params(d) if name.startswith(tuple(done)))
    grads += 0 if d.tied else d.V_l * d.H
    tied_head = d.V_l * d.H * d.w if d.tied else 0
    flowing = d.p * (d.Ns * d.H + d.N * v_width)
    grads = buckets + (grads * d.w if own_grads else 0)
    activations = alive - freed
    return Moment("attention", P, grads, optim, activations, 2 * FP32 * scores + tied_head + flowing)


# --- communication ------------------------------------------------------------------------------


def _ring(op: str, full_bytes: int, world: int) -> int:
    """Per-rank bytes on the wire of one ring collective, rounded as CommCounter rounds each call."""
    factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    return round(full_bytes * factor)


def comm_rows(cfg: RunConfig) -> list[CommRow]:
    """(op, purpose, count, bytes) of one training step on one rank, as CommCounter counts them."""
    d = dims(cfg)
    rows: dict[tuple[str, str], list[int]] = {}

    def add(op: str, purpose: str, full_bytes: int, world: int, count: int = 1) -> None:
        if world > 1 and count > 0:
            row = rows.setdefault((op, purpose), [0, 0])
            row[0] += count
            row[1] += count * _ring(op, full_bytes, world)

    skip = set(cfg.debug.skip_grad_sum)
    if d.ddp:
        cap = int(cfg.parallel.ddp_bucket_mb * 2**20)
        for size in ddp_buckets(d, cap, rebuilt=cfg.train.warmup > 0):
            add("all_reduce", "dp_grad", size, d.dp)
        return _sorted(rows)

    T, L, N, H = d.T, d.L, d.N, d.H
    # Element bytes of what enters a region (a norm output or the embedding, and their gradients) and
    # of what leaves it (a row-parallel output and its gradient). Mixed precision: the stream and the
    # norms are fp32, the linears' outputs are in the autocast dtype.
    e_in, e_out = (FP32 if d.mixed else d.p), d.p
    if not d.sp:  # per block: f-bar forward (2 exits), f backward (2 entries); VP: embedding, head
        add("all_reduce", "activation", N * H * e_out, T, 2 * L)
        add("all_reduce", "activation", N * H * e_in, T, 2 * L + (2 if d.vp else 0))
    else:  # g forward / reduce-scatter backward; g-bar reduce-scatter forward / all-gather backward
        edges = 2  # embedding and head: split or reduce-scatter, gather-replicated or g
        add("all_gather", "activation", N * H * e_in, T, 2 * L + edges)
        add("all_gather", "activation", N * H * e_out, T, 2 * L)
        add("reduce_scatter", "activation", N * H * e_in, T, 2 * L + (2 if d.vp else 0))
        add("reduce_scatter", "activation", N * H * e_out, T, 2 * L)
        # backward all-gathers each saved shard again: 2 per block, + the VP head. Under autocast the
        # linears save their bf16 casts of the gathered input, not the input: no shard, no re-gather
        if d.regather and not d.mixed:
            add("all_gather", "regather", N * H * e_in, T, 2 * L + (1 if d.vp else 0))
    if d.vp:  # max, target logit, sum of exp: [S, B] fp32 each
        add("all_reduce", "loss", N * FP32, T, 3)
    if T > 1:
        tp_sums = (2 * L * d.D if "qk_norm" not in skip else 0) + (
            (2 * L + 1) * H if d.sp and "sp_norms" not in skip else 0
        )  # q/k norm weights (each rank saw its heads), SP norms (each rank saw its tokens)
        if tp_sums:
            add("all_reduce", "grad_sum", tp_sums * d.w, T)
        if d.Nkv % T and "kv_replicas" not in skip:  # ranks sharing one KV head sum k/v grads
            add("all_reduce", "grad_sum", 2 * L * d.D * H * d.w, T // d.Nkv)
    if "dp" not in skip:
        add("all_reduce", "dp_grad", sum(n for _, n in params(d)) * d.w, d.dp)
    return _sorted(rows)


def _sorted(rows: dict[tuple[str, str], list[int]]) -> list[CommRow]:
    return [CommRow(op, purpose, n, b) for (op, purpose), (n, b) in sorted(rows.items())]


# --- FLOPs --------------------------------------------------------------------------------------


def model_flops_per_step(cfg: RunConfig) -> float:
    """Dense-model FLOPs of one training step on the global batch: forward + backward (= 2 x forward)
    of every matmul, attention counted as the full S x S products (as FlopCounterMode and Megatron's
    formula count them; a causal kernel does about half). Independent of tp: the model's FLOPs."""
    d = dims(cfg)
    H, I, V, S = d.H, d.I, d.V, d.S  # noqa: E741
    kv = d.Nkv * d.D
    per_token_layer = 2 * (2 * H * H + 2 * H * kv + 3 * H * I) + 2 * 2 * S * H  # weights; QK^T, PV
    per_token = d.L * per_token_layer + 2 * H * V  # + the LM head
    return 3.0 * per_token * S * d.B * d.dp


# --- the prediction -----------------------------------------------------------------------------


@dataclass
class Prediction:
    dims: Dims
    moments: list[Moment]
    rows: list[CommRow]
    activation_terms: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> Moment:
        return max(self.moments, key=lambda m: m.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    @property
    def comm_bytes_per_step(self) -> int:
        return sum(r.bytes for r in self.rows)

    def breakdown(self) -> dict[str, int]:
        """The peak by MemTracker's categories, under tpbench's measurement names."""
        m = self.peak
        return {
            "mem_params_bytes": m.params,
            "mem_grads_bytes": m.grads,
            "mem_optimizer_bytes": m.optimizer,
            "mem_activations_bytes": m.activations,
            "mem_temporaries_bytes": m.temporaries,
        }

    def comm_rows(self) -> list[CommRow]:
        return list(self.rows)

    def max_memory_allocated_bytes(self, gpu: str) -> int:
        """What `torch.cuda.max_memory_allocated` would say on `gpu`: the live tensors at the peak and
        the cuBLAS workspaces, allocator blocks that hold no tensor (tpbench.allocator). Left out: the
        allocator's 512-B rounding and blocks handed out whole (a split would leave <= 1 MiB), which
        add 0.5-1.8% more on the seed's presets (README, "The seed's GPU table")."""
        return self.peak_bytes + CUBLAS_HANDLES * cublas_workspace_bytes(gpu)


def predict(cfg: RunConfig) -> Prediction:
    """Per-rank peak memory and collective bytes of one training step under `cfg`."""
    d = dims(cfg)
    return Prediction(d, moments(d), comm_rows(cfg), layer_activations(d))
