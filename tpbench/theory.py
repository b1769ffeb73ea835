"""The analytic model: per-rank memory and communication of one training step, for any config.

Memory is what torch's MemTracker sees on one rank: the bytes of live tensor storages. A step is
  zero_grad(set_to_none) -> forward -> loss -> backward -> gradient sums -> AdamW step,
so the peak is the largest of a few moments (`Prediction.moments`):
  loss          the cross entropy, every activation of the forward still saved for backward (the
                logits live only while the loss runs: the training step does not keep them);
  loss forward  mixed precision with recompute: a dense loss's forward, beside the weight casts that
                autocast's cache holds to the forward's end (gone by the loss's backward);
  loss backward the vocab-parallel loss's backward: the logits it keeps, becoming their gradient;
  head backward the LM head's backward: the logits' and the head weight's gradients;
  head weight cast's backward  mixed precision: that gradient cast to fp32 beside the bf16 one;
  final norm backward  the final RMSNorm's fp32 backward temporaries;
  down_proj backward   the top block's first matmul backward, its H x I weight gradient made (mixed:
                then cast to fp32, beside the bf16 one): the peak where few tokens meet the weights;
  swiglu backward      the top block's SwiGLU backward, at silu's;
  mlp backward  the top block's SwiGLU backward, at gate_proj's weight gradient;
  recomputed block     full recompute: the top and the bottom block's backward, their forward run
                again (the top one beside every block input, the bottom one beside most gradients);
  attention     the top layer's manual-attention backward, with its fp32 [B, N, S, S] gradients;
  backward end  a tied embedding's two gradients and their sum, beside all the others;
  embedding backward  an untied one's: its gradient made from the stream's, beside all the others;
  gradient sums megatron with DP: every gradient and a flat copy of them all being all-reduced;
  optimizer     AdamW: parameters, gradients, both moments and its temporaries (none when fused; on
                the CPU, one tensor's two beside the previous tensor's denominator).
Communication is what tpbench.parallel.comm.CommCounter counts: per-rank ring bytes per step.

Notation (per rank, T = tp): S sequence, B sequences per DP rank, N = S*B tokens, H hidden, D head dim,
Nq / Nkv query / key-value heads, I intermediate, V vocab (padded under VP), L layers.
Ns = N/T tokens of the residual stream under SP (N without). p bytes of an activation element,
w of a parameter element; 4 for the fp32 in which RMSNorm, softmax and the loss compute.

Saved activations per layer, bf16 (p = 2), bytes, T = 1, SDPA, GQA (Nkv < Nq), MiniMind's own
RMSNorm ops (model.lean_rmsnorm=false, as the seed's presets run them):
  2 RMSNorms        2 (4 + 4) N H           the fp32 copy of the input (pow and mul save it) and the
                                            fp32 normed tensor (the weight's mul saves it: MiniMind
                                            scales in fp32 and casts the product back)
  2 region inputs   2 * 2 N H               one tensor each, saved by q/k/v and by gate/up
  q/k norms         (4 + 4) N (H + Hkv)     the same RMSNorm over the head dim; Hkv = Nkv D
  q, k, v for SDPA  3 * 2 N H               rope(q); k and v copied by repeat_kv (expand + reshape)
                                            (a view when a rank holds a single KV head)
  SDPA out          2 N H + 4 B Nq S        viewed, not copied, as o_proj's input; + logsumexp
  SwiGLU            3 * 2 N I               gate and up (the fused silu-mul remakes silu(gate) in
                                            backward), their product (down)
= N H (36 + 8 Nkv/Nq + 6 I/H) bytes: 59.0 N H at heads 8/4 and I = 3.17 H, where the paper's GPT
layer (dropout, GeLU, 4H MLP) has 34 N H. A lean RMSNorm (model.lean_rmsnorm, the default) keeps
its bf16 input only and makes the rest again in its backward: 2 x 2 N H for the two norms, 2 N
(H + Hkv) for q/k norms, so N H (18 + 2 Nkv/Nq + 6 I/H), 38.0 N H at that shape.
RoPE saves only its cos/sin tables cast to p (they need no grad; the fp32 tables are built once per
device and kept: `model_activations`), the residual adds save nothing. Manual attention adds the
fp32 softmax and its cast: (4 + 2) B Nq S^2, the paper's 5 a S / H term. TP divides the per-head
and per-I terms by T, while the norms and the region inputs stay whole on every rank; SP divides
those too (the region inputs only with the re-gather), so that TP + SP saves 1/T of everything, as
in the paper.
With parallel.sp_gather=linear each column linear all-gathers its own input: without the re-gather
the 2 region inputs become 5 [S, B, H] tensors (q, k, v; gate, up each save their own), with it the
shard is saved once as before (every linear keeps the same one) and each linear gathers it again.

Mixed precision (fp32 masters, autocast): the stream and the norms are fp32, and every autocast op
saves its own bf16 casts: each linear's weight is cast once per forward and kept until its backward,
and q/k norms cast back to their input's dtype, the autocast dtype of q_proj's and k_proj's outputs,
so RoPE and SDPA run in it. With T > 1 each region entry casts its input to bf16 once,
before its collective, so that q, k, v (gate, up) share it and SP's re-gather keeps its bf16 shard;
the dense model (T = 1) lets each linear cast its own copy (3 for attention, 2 for the MLP).

Activation recompute (train.recompute, tpbench.parallel.recompute) changes the per-layer terms:
selective keeps each RMSNorm's input instead of its fp32 internals and gate, up instead of the three
SwiGLU tensors; full keeps each block's input only, and its backward holds one block's activations of
`none` (without the re-gather) at a time. Full adds, per block, the collectives of the forward up to
down_proj's input (SP: both entry all-gathers and the attention's reduce-scatter; TP: the attention's
all-reduce, purpose "recompute") and that forward's matmuls (`recompute_flops_per_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tpbench.allocator import CUBLAS_HANDLES, cublas_workspace_bytes
from tpbench.config import RunConfig, local_batch
from tpbench.models.minimind import default_intermediate_size
from tpbench.parallel.cross_entropy import LOSS_CHUNKS
from tpbench.parallel.plan import padded_vocab
from tpbench.results import CommRow

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32, INT64 = 4, 8
# the loss [] and its gradient [] (ones, made by backward()), alive from backward's start to its end;
# the loss alone outlives it (the step returns it)
LOSS_AND_GRAD = 2 * FP32


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
    fused_swiglu: bool
    lean_rmsnorm: bool  # each RMSNorm keeps its input only (model.lean_rmsnorm)
    tied: bool
    p: int  # bytes of an activation element
    w: int  # bytes of a parameter, gradient or optimizer-state element
    mixed: bool
    ddp: bool
    bucket_view: bool
    gpu: bool
    logits_mean: bool  # the seed's benchmark loss, logits.float().mean(), instead of cross entropy
    recompute: str = "none"  # none | selective | full (train.recompute)
    per_linear: bool = False  # SP's all-gather in each column linear (parallel.sp_gather=linear)
    fused_adam: bool = False  # train.fused_optimizer: AdamW's fused kernel
    keep_output: bool = False  # the logits and the final hidden states live to the step's end
    head_dim: int | None = None  # model.head_dim; None: H / Nq
    qk_norm: bool = True  # q/k RMSNorms over each head (model.qk_norm); off: none, nor their sums
    bias: bool = False  # q, k, v biases (model.attention_bias), sharded with their weights

    @property
    def s(self) -> int:
        """Bytes of a residual-stream element: fp32 under mixed precision (the embedding is fp32 and
        adding a bf16 branch to it stays fp32), else the activation dtype."""
        return FP32 if self.mixed else self.p

    @property
    def D(self) -> int:
        return self.H // self.Nq if self.head_dim is None else self.head_dim

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
        return self.Ns if self.sp and self.block_regather else self.N

    @property
    def block_regather(self) -> bool:
        """SP's re-gather inside the blocks: not under full recompute, where a block keeps only its
        input and its recomputed forward gathers again (the LM head still re-gathers)."""
        return self.regather and self.recompute != "full"

    @property
    def entries(self) -> int:
        """SP all-gathers per block entering its regions: one per region, or one per column linear
        (q, k, v; gate, up) under parallel.sp_gather=linear."""
        return 5 if self.per_linear else 2

    @property
    def cast_once(self) -> bool:
        """Mixed precision with T > 1: each region entry casts its input to the autocast dtype once,
        so the region's linears share one tensor (the dense model's linears each cast their own)."""
        return self.mixed and self.T > 1


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
        fused_swiglu=m.fused_swiglu,
        lean_rmsnorm=m.lean_rmsnorm,
        tied=m.tie_word_embeddings,
        p=BYTES[t.dtype],
        w=FP32 if mixed else BYTES[t.dtype],
        mixed=mixed,
        ddp=par.engine == "ddp",
        bucket_view=par.ddp_gradient_as_bucket_view,
        gpu=cfg.launch.device == "cuda",
        logits_mean=t.loss == "logits_mean",
        recompute=t.recompute,
        per_linear=par.sp and T > 1 and par.sp_gather == "linear",
        fused_adam=t.fused_optimizer,
        keep_output=t.keep_output,
        head_dim=m.head_dim,
        qk_norm=m.qk_norm,
        bias=m.attention_bias,
    )


# --- parameters ---------------------------------------------------------------------------------


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


# --- activations --------------------------------------------------------------------------------


def layer_activations(d: Dims) -> dict[str, int]:
    """Bytes one block saves for backward on this rank, term by term, under d.recompute.

    p is the activation dtype: train.dtype, or the autocast dtype under mixed precision, where the
    stream and the norms stay fp32 (d.s) and every autocast op saves its own bf16 casts: the linears'
    weights are cast once per forward (and kept, saved, until their backward); with T > 1 each region
    entry casts its input once for all its linears, while the dense model's (T = 1) q, k, v (gate,
    up) each cast it.

    A lean RMSNorm (model.lean_rmsnorm) keeps its input instead of its fp32 copy, rsqrt and fp32
    result. selective keeps gate and up instead of the three SwiGLU tensors (down_proj's weight cast,
    made inside, is remade too); full
    keeps the block's input only (under mixed precision the casts it remakes are still held, by
    autocast's cache, until the forward ends: `forward_only_casts`)."""
    N, Ns, S, B, H, p = d.N, d.Ns, d.S, d.B, d.H, d.p
    if d.recompute == "full":  # the stream entering the block, [S(/T), B, H]
        return {"block input": d.s * Ns * H, "weight casts": 0}
    selective, lean = d.recompute == "selective", d.lean_rmsnorm
    # fp32 input, rsqrt [Ns, 1], fp32 normed (the weight's mul saves it); lean: the input
    rmsnorm = d.s * Ns * H if lean else 2 * FP32 * Ns * H + FP32 * Ns
    if (d.mixed and not d.cast_once) or (d.per_linear and not d.block_regather):
        # q, k, v each save their own copy, gate and up too: a cast of the fp32 input (dense, mixed),
        # or the [S, B, H] each all-gathered (SP with parallel.sp_gather=linear, no re-gather)
        attn_input, mlp_input = 3 * p * N * H, 2 * p * N * H
    else:  # one tensor q/k/v (gate/up) share: under SP with the re-gather, only this rank's shard
        attn_input = mlp_input = p * d.saved_input_tokens * H
    k_width, v_width = kv_widths(d)
    if d.flash:  # SDPA saves its output (o_proj's input is a view of it) and the logsumexp
        core = p * N * d.Hq + FP32 * B * d.Nq_l * S
    else:  # fp32 softmax output, its cast (unless it is fp32 already), o_proj's input copy
        core = (FP32 + (p if p != FP32 else 0)) * B * d.Nq_l * S * S + p * N * d.Hq

    def head_norm(width: int, heads: int) -> int:  # q_norm / k_norm over [N, heads, D]
        return p * N * width if lean else 2 * FP32 * N * width + FP32 * N * heads

    terms = {
        "input_layernorm": rmsnorm,
        "attention input": attn_input,
        "q_norm": head_norm(d.Hq, d.Nq_l) if d.qk_norm else 0,
        "k_norm": head_norm(d.Hkv, d.Nkv_l) if d.qk_norm else 0,
        "rope tables": 4 * S * d.D * p if p != FP32 else 0,  # cos, sin cast to p, for q and for k
        "q, k, v": p * N * (d.Hq + k_width + v_width),
        "attention core": core,
        "post_attention_layernorm": rmsnorm,
        "mlp input": mlp_input,
        # gate, up; the product (down_proj's input); MiniMind's unfused ops keep silu(gate) too
        "swiglu": (2 if selective else 3 if d.fused_swiglu else 4) * p * N * d.I_l,
    }
    if d.mixed:
        terms["weight casts"] = p * block_linears(d) - forward_only_casts(d) // d.L
    return terms


def block_linears(d: Dims) -> int:
    """Elements of one block's linear weights on this rank (their biases left out)."""
    return sum(n for name, n in layer_params(d) if not name.endswith(("norm", ".bias")))


def forward_only_casts(d: Dims) -> int:
    """Mixed precision: bf16 weight casts that autocast's cache holds until the forward ends but
    backward does not keep, since recompute makes them again: every block linear's under full,
    down_proj's under selective (made inside its checkpointed SwiGLU)."""
    if not d.mixed or d.recompute == "none":
        return 0
    per_layer = block_linears(d) if d.recompute == "full" else d.H * d.I_l
    return d.L * d.p * per_layer


def bias_casts(d: Dims) -> int:
    """Mixed precision with q/k/v biases: their bf16 casts, which autocast's cache holds until the
    forward ends (no backward saves a bias: its gradient is the output gradient's sum)."""
    return d.L * d.p * (d.Hq + 2 * d.Hkv) if d.mixed and d.bias else 0


def kv_widths(d: Dims) -> tuple[int, int]:
    """Widths of the k and v that attention saves. repeat_kv's expand + reshape copies them out to the
    query heads, unless this rank has one KV head: then the expanded size-1 dim merges into a
    stride-0 view and nothing is copied. SDPA saves that view; manual attention's matmuls reshape it
    to [B Nq, S, D], which copies it (and saves the copy) unless B is 1: a size-1 batch dim merges
    with the stride-0 head dim into a view."""
    n_rep = d.Nq_l > d.Nkv_l
    v_width = d.Hq if n_rep and (d.Nkv_l > 1 or not d.flash and d.B > 1) else d.Hkv
    return v_width, v_width


def model_activations(d: Dims) -> dict[str, int]:
    """Bytes saved for backward outside the blocks, and the tensors the step holds all along. The
    logits are not here: the loss holds them while it runs (`loss_extra`), nothing after it."""
    N, Ns, H, p = d.N, d.Ns, d.H, d.p
    # the LM head's input: the shard under SP + VP with the re-gather (cast once under mixed
    # precision, as a region entry), else the whole [S, B, H] (the dense head's own cast, if mixed)
    head_input = p * (Ns if d.sp and d.vp and d.regather else N) * H
    return {
        "blocks": d.L * sum(layer_activations(d).values()),
        "embedding": (INT64 + 1) * d.N if d.vp else 0,  # VP: masked local ids (int64), out-of-range mask
        "rope tables": 2 * FP32 * d.S * d.D,  # cos, sin [S, D] fp32, built once and kept by the model
        "final norm": d.s * Ns * H if d.lean_rmsnorm else 2 * FP32 * Ns * H + FP32 * Ns,
        "head input": head_input,
        "head weight cast": p * d.V_l * H if d.mixed else 0,
        "batch": 2 * INT64 * d.B * d.dp * d.S,  # ids and labels of the global batch (sliced views)
    }


def loss_extra(d: Dims) -> tuple[int, int]:
    """(activation, temporary) bytes of the loss at its peak, beyond the saved activations.

    Dense loss (F.cross_entropy on logits.float()): the peak is log_softmax's backward, holding its
    fp32 output (saved), the fp32 gradient from nll_loss and the fp32 gradient it makes: 3 x 4 N V
    (the logits themselves are gone by then: nothing saves them), and the loss and its gradient.
    Vocab-parallel loss (tpbench.parallel.cross_entropy): its forward holds the logits, the [N]
    bookkeeping and one fp32 slice of LOSS_CHUNKS of the tokens (`loss_slice`); its backward is
    `loss_backward`.
    The seed's logits.float().mean(): the logits and their fp32 copy (unless they are fp32), with the
    loss and the gradient backward starts from (ones_like): MemTracker sees all four at backward's
    first op (tp 4, SP + VP); its backward is the logits' gradient of the head's backward."""
    nv = d.N * d.V_l
    if d.logits_mean:
        return d.p * nv + (FP32 * nv if d.p != FP32 else 0) + LOSS_AND_GRAD, 0
    if not d.vp:
        return FP32 * nv + LOSS_AND_GRAD, 2 * FP32 * nv
    # at a slice: targets and local ids (int64); row max, target logit, sum of exp (fp32); valid and
    # owned masks (bool)
    small = (2 * INT64 + 3 * FP32 + 2) * d.N
    return d.p * nv + small, loss_slice(d)


def loss_forward(d: Dims) -> int:
    """Bytes of a dense loss at the end of its forward, beyond the saved activations: the logits and
    their fp32 copy (unless they are fp32); cross entropy's log_softmax output, the shifted targets
    (int64 [N]), the loss and nll's total weight; the mean's scalar. Only beside the forward-only
    weight casts (mixed precision with recompute) can it outgrow the loss's backward."""
    nv = d.N * d.V_l
    logits = d.p * nv + (FP32 * nv if d.p != FP32 else 0)
    if d.logits_mean:
        return logits + FP32
    return logits + FP32 * nv + INT64 * d.N + 2 * FP32


def loss_slice(d: Dims) -> int:
    """Bytes of the vocab-parallel loss's fp32 work on one slice of the tokens: [N / LOSS_CHUNKS, V/T]."""
    return FP32 * math.ceil(d.N / LOSS_CHUNKS) * d.V_l


def loss_backward(d: Dims) -> tuple[int, int]:
    """(activation, temporary) bytes of the vocab-parallel loss's backward at a slice's one-hot, beyond
    the saved activations: the logits it keeps (becoming their own gradient, slice by slice), each
    row's max and sum of exp and the gradient's scale (fp32), the local ids and the count of valid
    targets (int64), valid and owned masks, the loss and its gradient; the slice, and the slice's
    owned mask in fp32 and negated (scatter_add_'s source)."""
    rows = math.ceil(d.N / LOSS_CHUNKS)
    act = d.p * d.N * d.V_l + (INT64 + 3 * FP32 + 2) * d.N + INT64 + LOSS_AND_GRAD
    return act, loss_slice(d) + 2 * FP32 * rows


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
    # AdamW: exp_avg and exp_avg_sq like the parameters, plus a 4-byte `step` per tensor on the
    # parameters' device (a GPU's non-fused AdamW keeps it on the host)
    O = 2 * P + (0 if d.gpu and not d.fused_adam else FP32 * len(sizes))  # noqa: E741
    # DDP's buckets live from construction; gradient_as_bucket_view makes the gradients views of them
    buckets = P if d.ddp else 0
    G = P if not (d.ddp and d.bucket_view) else 0  # gradients made in backward
    acts = model_activations(d)
    A = sum(acts.values())
    # what outlives the backward: the batch, the model's RoPE tables and the loss the step returns
    kept = acts["batch"] + acts["rope tables"] + FP32

    loss_act, loss_temp = loss_extra(d)
    casts = forward_only_casts(d) + bias_casts(d)  # autocast's cache holds them to the forward's end
    if d.vp and not d.logits_mean:  # the vocab-parallel loss: its forward (casts held), its backward
        back_act, back_temp = loss_backward(d)
        out = [
            Moment("loss", P, buckets, O, A + casts + loss_act, loss_temp),
            Moment("loss backward", P, buckets, O, A + back_act, back_temp),
        ]
    else:  # the dense losses peak in their backward, the casts gone; their forward, beside the casts
        out = [Moment("loss", P, buckets, O, A + loss_act, loss_temp)]
        if casts:
            out.append(Moment("loss forward", P, buckets, O, A + casts + loss_forward(d), 0))

    # the LM head's backward: the logits' gradient, the head's weight gradient (not yet accumulated
    # into .grad; in the matmul's dtype: under mixed precision the bf16 weight cast's, cast to fp32
    # once the logits' gradient is freed) and its input gradient, with every activation still saved
    temp = d.p * d.N * d.V_l + d.V_l * d.H * d.p + d.p * d.N * d.H
    if d.sp and d.vp and d.regather:  # the head's input, all-gathered again
        temp += d.p * d.N * d.H
    out.append(Moment("head backward", P, buckets, O, A + LOSS_AND_GRAD, temp))
    if d.mixed:  # the head's weight gradient cast to fp32, beside its bf16 one and the input's gradient
        after = A - acts["head input"] - acts["head weight cast"] + LOSS_AND_GRAD
        cast = d.V_l * d.H * (d.p + d.w) + d.s * d.N * d.H
        out.append(Moment("head weight cast's backward", P, buckets, O, after, cast))
    out.append(final_norm_backward(d, acts, P, O, buckets, G > 0))
    if d.recompute == "full":
        out += [recomputed_block(d, acts, P, O, buckets, G > 0, i) for i in sorted({d.L - 1, 0})]
    else:
        out += down_backward(d, acts, P, O, buckets, G > 0)
        out.append(swiglu_backward(d, acts, P, O, buckets, G > 0))
        out.append(post_attention_norm_backward(d, acts, P, O, buckets, G > 0))
        if d.qk_norm:
            out += [head_norm_backward(d, acts, P, O, buckets, G > 0, n) for n in ("k_norm", "q_norm")]
        out.append(mlp_backward(d, acts, P, O, buckets, G > 0))
    if not d.flash and d.recompute != "full":
        out.append(attention_forward(d, acts, P, O, buckets))
        out.append(attention_backward(d, acts, P, O, buckets, G > 0, d.L - 1))
    elif not d.flash:
        out += [attention_backward(d, acts, P, O, buckets, G > 0, i) for i in sorted({d.L - 1, 0})]

    if d.tied:  # the LM head's gradient waits for the embedding's; the two are summed into a third
        E = d.V_l * d.H * d.w
        own = G - E if G else 0
        out.append(Moment("backward end", P, buckets + own, O, kept + LOSS_AND_GRAD - FP32, 3 * E))
    else:  # the embedding's backward: its gradient being made from the stream's [S, B, H] gradient
        # (gathered whole under SP), every other gradient made; the fused AdamW's moment is below it
        E = d.V_l * d.H * d.w
        own = G - E if G else 0
        temps = E + d.s * d.N * d.H
        out.append(Moment("embedding backward", P, buckets + own, O, kept + LOSS_AND_GRAD - FP32, temps))
    if d.dp > 1 and not d.ddp:  # megatron's DP sum concatenates every gradient into one flat copy
        out.append(Moment("gradient sums", P, buckets + G, O, kept, P))
    # AdamW on the CPU runs one tensor at a time, in the parameters' order: a tensor's sqrt(exp_avg_sq)
    # and its quotient by the bias correction live together beside the previous tensor's `denom`, which
    # the loop's variable holds until the new one is assigned; foreach (GPU) makes them for all at once;
    # the fused kernel updates each element in place and makes none
    single = max(2 * n + before for n, before in zip(sizes, [0] + sizes[:-1], strict=True))
    adam_temp = 0 if d.fused_adam else P if d.gpu else single * d.w
    out.append(Moment("optimizer", P, buckets + G, O, kept, adam_temp))
    return kept_output(d, acts, out) if d.keep_output else out


def kept_output(d: Dims, acts: dict[str, int], out: list[Moment]) -> list[Moment]:
    """train.keep_output: the step holds the model's output to its end, as the seed's and
    minimind-tron's benchmarks hold `output`: the logits [S, B, V/T] (p) and the final hidden states
    (the decoder's output: whole, or this rank's shard under SP with VP, whose head gathers itself; in
    the stream's dtype, fp32 under mixed precision). Where the LM head saves that very tensor (pure
    precision; under SP with VP, with the re-gather) it is held from the head's backward on, which would
    free it; otherwise (the head saves its own cast, or its own gathered copy) from the forward on.
    The logits are held at every moment after the forward; at the loss, the dense loss's peak is its
    backward, where the logits would be gone (cross entropy), or the mean's gradient in fp32 and its
    cast (logits_mean): held beside them. (The vocab-parallel cross entropy turns the logits into their
    gradient in place: compose refuses keep_output with it.)"""
    logits = d.p * d.N * d.V_l
    hidden = d.s * (d.Ns if d.sp and d.vp else d.N) * d.H
    early = hidden if d.mixed or (d.sp and d.vp and not d.regather) else 0
    held = {"attention forward": 0, "loss": logits + early, "head backward": logits + early}
    return [replace(m, activations=m.activations + held.get(m.name, logits + hidden)) for m in out]


def final_norm_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The final RMSNorm's backward. MiniMind's RMSNorm computes in fp32, and its backward (pow's,
    mean's and mul's gradients and their sum) holds 5 fp32 [Ns, H] temporaries at once beside its
    saved fp32 input (MemTracker on the norm alone, bf16 and fp32 alike). The loss and the head have
    run their backward: their saved tensors are freed, the head's gradient made (a tied head's waits,
    as a temporary, for the embedding's share); the norm's weight gradient is made too.
    A lean norm has made its fp32 copy of the input again (unless the input is fp32: x.float() is x),
    and its normed result and rsqrt, which are freed by then as they are without it."""
    freed = acts["head input"] + acts["head weight cast"]
    if not d.lean_rmsnorm:
        freed += FP32 * d.Ns * d.H + FP32 * d.Ns  # normed, rsqrt
    elif d.s != FP32:
        freed -= FP32 * d.Ns * d.H  # the fp32 copy, made again
    grads = d.H + (0 if d.tied else d.V_l * d.H)
    tied_head = d.V_l * d.H * d.w if d.tied else 0
    temps = 5 * FP32 * d.Ns * d.H + tied_head
    grads = buckets + (grads * d.w if own_grads else 0)
    activations = sum(acts.values()) - freed + LOSS_AND_GRAD
    return Moment("final norm backward", P, grads, optim, activations, temps)


def recomputed(d: Dims) -> dict[str, int]:
    """What a block recomputed under full recompute saves while its backward runs, beyond its input:
    everything of `none`, the whole gathered region inputs included (the re-gather is off inside the
    blocks). A lean first norm keeps the block input, held already; so does a norm's fp32 copy of an
    fp32 stream (x.float() is x)."""
    terms = layer_activations(replace(d, recompute="none", regather=False))
    if d.lean_rmsnorm or d.s == FP32:
        terms["input_layernorm"] -= d.s * d.Ns * d.H
    return terms


def after_head(acts: dict[str, int]) -> int:
    """What the step still saves once the final norm's backward is done: the head's input and weight
    cast and the final norm's tensors are freed."""
    return sum(acts.values()) - acts["final norm"] - acts["head input"] - acts["head weight cast"]


def recomputed_block(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Full recompute: block `layer`'s backward, in the SwiGLU's. Its forward has run again (to
    down_proj's input) and down_proj's backward is done: its input (and, mixed, its weight cast) is
    freed, its weight gradient made; three tensors of the SwiGLU's size are alive (the gradient of
    silu(gate) * up and, one after the other, two of grad * up, gate's gradient and up's), with the
    stream's gradient (fp32 under mixed precision, as the stream).
    The blocks above have finished: their inputs are freed, their gradients made, as are the head's
    and the final norm's (a tied head's waits, as a temporary, for the embedding's share). The top
    block holds the most activations, the bottom one the most gradients."""
    ffn = d.p * d.N * d.I_l
    above = d.L - 1 - layer
    block_input = acts["blocks"] // d.L
    activations = after_head(acts) - above * block_input
    activations += sum(recomputed(d).values()) - ffn - (d.p * d.H * d.I_l if d.mixed else 0)
    activations += LOSS_AND_GRAD
    block = sum(n for _, n in layer_params(d))
    grads = d.H + above * block + d.H * d.I_l + (0 if d.tied else d.V_l * d.H)
    tied_head = d.V_l * d.H * d.w if d.tied else 0
    temps = 3 * ffn + d.s * d.Ns * d.H + tied_head
    grads = buckets + (grads * d.w if own_grads else 0)
    return Moment(f"recomputed block {layer}", P, grads, optim, activations, temps)


def top_block_grads(d: Dims, done: tuple[str, ...] | list[str], buckets: int, own_grads: bool) -> int:
    """Gradient bytes once the top block's `done` parameters have run their backward: theirs, the final
    norm's and an untied head's (a tied head's waits, as a temporary, for the embedding's share),
    beside DDP's buckets."""
    done_params = sum(n for name, n in layer_params(d) if name.removesuffix(".bias") in done)
    grads = d.H + done_params + (0 if d.tied else d.V_l * d.H)
    return buckets + (grads * d.w if own_grads else 0)


def swiglu_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The top block's SwiGLU backward, at silu's backward: down_proj's backward is done (its input,
    the SwiGLU's product, is freed, as is its weight cast under mixed precision; selective recompute
    made both again and freed them there), its weight gradient made. Alive: three tensors of the
    SwiGLU's size (the product's gradient, its product with up, silu's backward being made; MiniMind's
    unfused ops: the two products and silu's backward), the stream's gradient, and a tied head's
    gradient, waiting (a temporary) for the embedding's share. The fused SwiGLU still keeps gate and
    up, MiniMind's ops gate alone (mul's saved silu(gate) and up are freed once its backward ran)."""
    ffn = d.p * d.N * d.I_l
    freed = layer_activations(d)["swiglu"] - (2 if d.fused_swiglu else 1) * ffn
    if d.mixed and d.recompute == "none":
        freed += d.p * d.I_l * d.H  # down's weight cast
    done = ("mlp.down_proj",)
    temps = 3 * ffn + d.s * d.Ns * d.H + (d.V_l * d.H * d.w if d.tied else 0)
    grads = top_block_grads(d, done, buckets, own_grads)
    return Moment("swiglu backward", P, grads, optim, after_head(acts) - freed + LOSS_AND_GRAD, temps)


def down_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> list[Moment]:
    """The top block's down_proj backward, the block's first, inside its matmul's backward: down's
    input gradient [N, I/T] and weight gradient [H, I/T] made, in the matmul's dtype, beside all the
    step still saves (down's input, and its weight cast under mixed precision, among it). Alive with
    them: the incoming gradient, the stream's ([Ns, H], in its dtype; mixed, also its cast for down's
    bf16 output; under SP, g-bar's all-gathered [N, H]) and a tied head's gradient, waiting (a
    temporary) for the embedding's share. Under mixed precision the weight gradient is then cast to
    fp32 for the master weight's .grad, in the cast's backward: down's matmul has let go of its input,
    its weight cast and the cast gradient of its output, and the fp32 weight gradient lives beside the
    bf16 one. Few tokens beside an H x I weight (small S) make either the peak. Selective recompute
    has made down's input (and weight cast) again for it, as full recompute does the block's."""
    ffn, weight = d.p * d.N * d.I_l, d.I_l * d.H
    incoming = d.s * d.Ns * d.H + (d.p * d.N * d.H if d.sp else 0)
    temps = ffn + d.p * weight + incoming + (d.V_l * d.H * d.w if d.tied else 0)
    grads = top_block_grads(d, (), buckets, own_grads)
    activations = after_head(acts) + LOSS_AND_GRAD
    if d.recompute == "selective":  # down's input (and weight cast) made again, not kept from forward
        activations += ffn + (d.p * weight if d.mixed else 0)
    cast_grad = d.p * d.N * d.H if d.mixed else 0
    out = [Moment("down_proj backward", P, grads, optim, activations, temps + cast_grad)]
    if d.mixed:
        freed = ffn + d.p * weight
        cast = Moment(
            "down_proj weight cast's backward", P, grads, optim, activations - freed, temps + d.w * weight
        )
        out.append(cast)
    return out


def post_attention_norm_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool
) -> Moment:
    """The top block's post-attention RMSNorm backward, at pow's backward: 5 fp32 temporaries of the
    stream's shape, the stream's gradient among them (as the final norm's), and a sixth where a lean
    norm has made its fp32 input again (unless the stream is fp32). The MLP has run its backward: its
    input, the SwiGLU's tensors (and, mixed, its weight casts) are freed, its weight gradients made."""
    layer = layer_activations(d)
    freed = layer["mlp input"] + layer["swiglu"]
    if d.mixed:
        freed += d.p * sum(n for name, n in layer_params(d) if name.startswith("mlp."))
        freed -= forward_only_casts(d) // d.L  # selective: down's cast was never kept
    if not d.lean_rmsnorm:  # its normed result and rsqrt
        freed += FP32 * d.Ns * d.H + FP32 * d.Ns
    temps = (6 if d.lean_rmsnorm and d.s != FP32 else 5) * FP32 * d.Ns * d.H
    temps += d.V_l * d.H * d.w if d.tied else 0
    done = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"]
    grads = top_block_grads(d, done, buckets, own_grads)
    activations = after_head(acts) - freed + LOSS_AND_GRAD
    return Moment("post-attention norm backward", P, grads, optim, activations, temps)


def head_norm_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, norm: str
) -> Moment:
    """The top block's k_norm or q_norm backward, at pow's backward (as the final norm's, 5 fp32
    temporaries of its input's shape beside its fp32 input, which a lean norm has made again: a sixth
    unless the input is fp32). Autograd runs the attention's branches latest-made first: both RoPEs,
    v_proj (its input gradient waits, [N, H], beside SP's re-gathered input), then k_norm, q_norm, and
    only then k_proj and q_proj. The block's MLP, post-attention norm, o_proj, attention core, RoPE
    tables and v_proj have run their backward and freed what they saved; the norms keep their inputs
    until theirs. At k_norm's, q_norm's incoming gradient waits; at q_norm's, k_norm's result, the
    gradient of k_proj's output [N, Hkv], waits for k_proj (measured at head_dim 16, where q_norm's is
    the peak: k_proj's weight gradient not made yet)."""
    layer = layer_activations(d)
    width = d.Hkv if norm == "k_norm" else d.Hq
    freed = sum(layer[k] for k in ("post_attention_layernorm", "mlp input", "swiglu", "attention core"))
    freed += layer["q, k, v"] + layer["rope tables"]
    done = ["self_attn.o_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    done += ["post_attention_layernorm", f"self_attn.{norm}"]  # its weight's gradient precedes pow's
    if norm == "q_norm":  # k_norm has run its backward, k_proj not yet
        freed += layer["k_norm"]
        done += ["self_attn.k_norm"]
    if d.mixed:  # the weight casts of the linears that ran their backward
        pending = ("self_attn.q_proj", "self_attn.k_proj")
        freed += layer["weight casts"] - d.p * sum(
            n for name, n in layer_params(d) if name in pending and name not in done
        )
    own_input = (d.mixed and not d.cast_once) or (d.per_linear and not d.block_regather)
    if own_input:  # each linear's own copy of the input: v's freed
        freed += d.p * d.N * d.H
    if not d.lean_rmsnorm:  # the running norm's normed result and rsqrt are freed
        freed += FP32 * d.N * width + FP32 * d.N * width // d.D
    norm_temps = (6 if d.lean_rmsnorm and d.p != FP32 else 5) * FP32 * d.N * width
    temps = norm_temps + d.s * d.Ns * d.H + d.p * d.N * d.H  # stream's and the attention input's gradients
    if norm == "k_norm":
        temps += d.p * d.N * d.Hq  # q_norm's incoming gradient
    else:
        temps += d.p * d.N * d.Hkv  # k_norm's result gradient, k_proj's to take
    if d.sp and d.block_regather and not d.per_linear:
        temps += d.p * d.N * d.H  # the re-gathered attention input
    temps += d.V_l * d.H * d.w if d.tied else 0
    grads = top_block_grads(d, done, buckets, own_grads)
    return Moment(f"{norm} backward", P, grads, optim, after_head(acts) - freed + LOSS_AND_GRAD, temps)


def mlp_backward(d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool) -> Moment:
    """The top block's SwiGLU backward, at gate_proj's weight gradient (the MLP's last matmul in
    backward: up_proj's runs first). Down's and up's backward are done: the SwiGLU's saved tensors are
    freed (mixed: down's and up's weight casts too, and up's own cast of the input where each linear
    casts its own), their weight gradients made. Alive: gate's gradient [N, I/T], up's and gate's
    input gradients [N, H] (summed once gate's backward ends), gate's weight gradient being made, the
    stream's gradient, SP's re-gathered MLP input, and a tied head's gradient, waiting (a temporary)
    for the embedding's share. The MLP input itself is still saved: gate's backward reads it."""
    layer = layer_activations(d)
    freed = layer["swiglu"]
    if d.mixed:
        freed += d.p * d.I_l * d.H * (2 if d.recompute == "none" else 1)  # up's (selective: down's is remade)
        freed += 0 if d.cast_once else d.p * d.N * d.H
    done = ("mlp.down_proj", "mlp.up_proj")
    temps = d.p * d.N * d.I_l + 2 * d.p * d.N * d.H + d.p * d.I_l * d.H + d.s * d.Ns * d.H
    temps += (d.V_l * d.H * d.w if d.tied else 0) + (d.p * d.N * d.H if d.sp and d.block_regather else 0)
    grads = top_block_grads(d, done, buckets, own_grads)
    return Moment("mlp backward", P, grads, optim, after_head(acts) - freed + LOSS_AND_GRAD, temps)


def attention_forward(d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int) -> Moment:
    """The top block's manual-attention forward, at its softmax: the scores [B, Nq, S, S] (p, a local
    of the forward until it returns), their fp32 sum with the causal mask, the fp32 softmax output
    (saved) and the mask [S, S] itself. Under SP with the re-gather the gathered region input is alive
    too (only its shard stays saved; a column linear's own gathered input, parallel.sp_gather=linear,
    is freed once it returns). The top block's MLP, o_proj and final norm have not run yet."""
    layer = layer_activations(d)
    scores = d.B * d.Nq_l * d.S * d.S
    later = layer["post_attention_layernorm"] + layer["mlp input"] + layer["swiglu"] + layer["attention core"]
    if d.mixed:  # o_proj's and the MLP's weight casts are not made yet
        later += d.p * sum(n for name, n in layer_params(d) if name.startswith(("mlp.", "self_attn.o_proj")))
    gathered = d.p * d.N * d.H if d.sp and d.block_regather and not d.per_linear else 0
    temps = d.p * scores + FP32 * scores + FP32 * d.S * d.S + gathered
    activations = after_head(acts) - later + FP32 * scores + bias_casts(d)
    return Moment("attention forward", P, buckets, optim, activations + temps, 0)


def attention_backward(
    d: Dims, acts: dict[str, int], P: int, optim: int, buckets: int, own_grads: bool, layer: int
) -> Moment:
    """Block `layer`'s manual-attention backward, at softmax's backward: the fp32 softmax output
    (saved), the fp32 gradient of the probabilities and the fp32 result, 3 x 4 B Nq S^2 at once.
    By then the head, the final norm, the MLP and o_proj have run their backward: their saved
    tensors are freed (mixed: their weight casts too) and their gradients made. A tied LM head's
    gradient waits, as a temporary, for the embedding's share. Also alive: the residual stream's
    gradient (fp32 under mixed precision, as the stream) and v's (its node runs later).
    Without full recompute, `layer` is the top block. Under full recompute its activations are the
    recomputed ones, and, as for `recomputed_block`, the blocks above have finished (their inputs
    freed, their gradients made): the top block holds the most activations, the bottom one the most
    gradients (mixed precision: fp32 gradients beside bf16 activations)."""
    full = d.recompute == "full"
    saved = recomputed(d) if full else layer_activations(d)
    scores = d.B * d.Nq_l * d.S * d.S
    v_width = kv_widths(d)[1]
    freed = saved["post_attention_layernorm"] + saved["mlp input"] + saved["swiglu"]
    freed += (d.p * scores if d.p != FP32 else 0) + d.p * d.N * (d.Hq + v_width)  # probs, o in, v
    done = ["mlp.", "post_attention_layernorm", "self_attn.o_proj"]
    if d.mixed:  # the weight casts of o_proj and the MLP (selective remakes down's: not kept)
        freed += d.p * sum(n for name, n in layer_params(d) if name.startswith(("mlp.", "self_attn.o_proj")))
        freed -= d.p * d.H * d.I_l if d.recompute == "selective" else 0
    above = d.L - 1 - layer
    grads = d.H + sum(n for name, n in layer_params(d) if name.startswith(tuple(done)))
    grads += above * sum(n for _, n in layer_params(d)) + (0 if d.tied else d.V_l * d.H)
    tied_head = d.V_l * d.H * d.w if d.tied else 0
    flowing = d.s * d.Ns * d.H + d.p * d.N * v_width
    grads = buckets + (grads * d.w if own_grads else 0)
    activations = after_head(acts) - above * (acts["blocks"] // d.L) - freed + LOSS_AND_GRAD
    activations += sum(saved.values()) if full else 0
    name = f"recomputed attention {layer}" if full else "attention"
    return Moment(name, P, grads, optim, activations, 2 * FP32 * scores + tied_head + flowing)


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
    # Element bytes: `a` of what crosses a region's boundary (its entry's input, cast to the autocast
    # dtype under mixed precision, a row-parallel output, their gradients); `e` of the stream at the
    # edges (the embedding's output, the replicated head's input), fp32 under mixed precision.
    a, e = d.p, d.s
    g = d.entries  # entries per block: 2 regions, or SP's 5 column linears (sp_gather=linear)
    regions, vp = g * L + (1 if d.vp else 0), 1 if d.vp else 0  # entries per block, the VP head
    if not d.sp:  # f-bar forward at 2L exits, f backward at every entry; VP: the embedding's f-bar
        add("all_reduce", "activation", N * H * a, T, 2 * L + regions)
        add("all_reduce", "activation", N * H * e, T, vp)
    else:  # g all-gathers forward, reduce-scatters backward; g-bar the other way round
        add("all_gather", "activation", N * H * a, T, regions + 2 * L)
        add("reduce_scatter", "activation", N * H * a, T, regions + 2 * L)
        # the embedding: VP's g-bar (reduce-scatter, all-gather backward), else the split's backward
        # all-gather; without VP, the replicated head's all-gather
        add("all_gather", "activation", N * H * e, T, 1 if d.vp else 2)
        add("reduce_scatter", "activation", N * H * e, T, vp)
        if d.regather:  # backward all-gathers each saved shard again: g per block, + the VP head
            add("all_gather", "regather", N * H * a, T, (g * L if d.block_regather else 0) + vp)
    if d.recompute == "full":  # each block's forward again, to down_proj: every entry (SP: g),
        if d.sp:  # and the attention's exit
            add("all_gather", "recompute", N * H * a, T, g * L)
            add("reduce_scatter", "recompute", N * H * a, T, L)
        else:
            add("all_reduce", "recompute", N * H * a, T, L)
    if d.vp and not d.logits_mean:  # the loss: max, target logit, sum of exp, [S, B] fp32 each
        add("all_reduce", "loss", N * FP32, T, 3)
    if T > 1:
        tp_sums = (2 * L * d.D if d.qk_norm and "qk_norm" not in skip else 0) + (
            (2 * L + 1) * H if d.sp and "sp_norms" not in skip else 0
        )  # q/k norm weights (each rank saw its heads), SP norms (each rank saw its tokens)
        if tp_sums:
            add("all_reduce", "grad_sum", tp_sums * d.w, T)
        if d.Nkv % T and "kv_replicas" not in skip:  # ranks sharing one KV head sum k/v grads
            add("all_reduce", "grad_sum", 2 * L * d.D * (H + d.bias) * d.w, T // d.Nkv)
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
    q, kv = d.Nq * d.D, d.Nkv * d.D
    per_token_layer = 2 * (2 * H * q + 2 * H * kv + 3 * H * I) + 2 * 2 * S * q  # weights; QK^T, PV
    per_token = d.L * per_token_layer + 2 * H * V  # + the LM head
    return 3.0 * per_token * S * d.B * d.dp


def recompute_flops_per_step(cfg: RunConfig) -> float:
    """FLOPs that activation recompute adds to one training step, summed over every rank (as
    flops_per_step counts them; model FLOPs leave them out). Selective remakes elementwise results
    only: no matmul. Full runs each block's forward again up to down_proj's input: every matmul of
    the block but down_proj's, attention counted as the full S x S products."""
    d = dims(cfg)
    if d.recompute != "full":
        return 0.0
    N, H = d.N, d.H
    weights = 2 * N * H * (2 * d.Hq + 2 * d.Hkv + 2 * d.I_l)  # q, o; k, v; gate, up
    attention = 2 * 2 * d.B * d.Nq_l * d.S * d.S * d.D  # Q K^T and P V
    return float(d.L * (weights + attention) * d.T * d.dp)


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
