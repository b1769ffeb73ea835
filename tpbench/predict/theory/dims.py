"""The model's sizes seen from one rank, derived from the config (`Dims`), and the element sizes.

Notation (per rank, T = tp): S sequence, B sequences per DP rank, N = S*B tokens, H hidden, D head dim,
Nq / Nkv query / key-value heads, I intermediate, V vocab (padded under VP), L layers.
Ns = N/T tokens of the residual stream under SP (N without). p bytes of an activation element,
w of a parameter element; 4 for the fp32 in which RMSNorm, softmax and the loss compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpbench.config import RunConfig, lean_rmsnorm, local_batch
from tpbench.models.minimind import default_intermediate_size
from tpbench.parallel.plan import padded_vocab

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32, INT32, INT64 = 4, 4, 8
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
    recompute: str = "none"  # none | selective | full | op (train.recompute)
    per_linear: bool = False  # SP's all-gather in each column linear (parallel.sp_gather=linear)
    fused_adam: bool = False  # train.fused_optimizer: AdamW's fused kernel
    keep_output: bool = False  # the logits and the final hidden states live to the step's end
    head_dim: int | None = None  # model.head_dim; None: H / Nq
    qk_norm: bool = True  # q/k RMSNorms over each head (model.qk_norm); off: none, nor their sums
    bias: bool = False  # q, k, v biases (model.attention_bias), sharded with their weights
    dropout: bool = False  # model.dropout > 0: each dropout keeps a 1-byte mask (tpbench.models.dropout)
    overlap: bool = False  # parallel.overlap (megatron): with dp > 1, the DP gradients in flat buckets
    rope_cast_once: bool = False  # cos, sin cast once per block, shared by q and k (FSDP2's input cast)
    # model.fused_ops: RoPE's tables made once in p and shared by every block; SDPA takes k and v at
    # their own heads (enable_gqa). fused_loss: the log-softmax upcasts inside, with no fp32 copy of
    # the logits, which torch does on CUDA only (on a CPU, real or emulating a GPU, it copies them)
    fused_ops: bool = False
    fused_loss: bool = False
    # parallel.dp_shard where its shard group has more than one rank (else none): ZeRO-1's (optimizer)
    # or FSDP2's (grads, full) own the DP gradients and AdamW steps this rank's shard of dp_shards
    dp_shard: str = "none"
    dp_shards: int = 1
    # ZeRO-1's bucket size in elements (parallel.zero_bucket_elements, 0 resolved to Megatron's)
    zero_bucket: int = 40_000_000
    grad_clip: bool = False  # train.grad_clip > 0: the global norm and the scaling before AdamW
    # train.no_decay where AdamW has weight decay to group by (weights.adam_groups), else empty
    no_decay: tuple[str, ...] = ()
    # parallel.engine=dtensor (torch's DTensor TP, tpbench.parallel.dtensor): its SP keeps each region's
    # gathered input (no re-gather: `regather` is off), each column linear casts its own input under
    # mixed precision, and loss_parallel's cross entropy holds its own tensors (moments.dtensor_loss_*)
    dtensor: bool = False

    @property
    def flat_dp(self) -> bool:
        """Megatron's DP gradients in persistent flat buckets, `.grad` their views
        (tpbench.parallel.overlap.DPGradBuckets): parallel.overlap with dp > 1."""
        return self.overlap and self.dp > 1 and not self.ddp

    @property
    def deferred(self) -> bool:
        """parallel.overlap with TP: the column linears' weight gradients are deferred to their
        region's entry backward, their weights cast outside autocast's cache
        (tpbench.parallel.overlap.linear_deferred)."""
        return self.overlap and self.T > 1

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
        input and its recomputed forward gathers again, nor under op, whose policy keeps the gathered
        input (the LM head still re-gathers)."""
        return self.regather and self.recompute not in ("full", "op")

    @property
    def entries(self) -> int:
        """SP all-gathers per block entering its regions: one per region, or one per column linear
        (q, k, v; gate, up) under parallel.sp_gather=linear."""
        return 5 if self.per_linear else 2

    @property
    def cast_once(self) -> bool:
        """Mixed precision with T > 1: each region entry casts its input to the autocast dtype once,
        so the region's linears share one tensor (the dense model's linears each cast their own, and so
        do DTensor's: its region entry hands them a Replicate DTensor, which autocast casts per op)."""
        return self.mixed and self.T > 1 and not self.dtensor


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
        regather=par.sp_regather and par.engine != "dtensor",  # DTensor's SP keeps the gathered input
        flash=m.flash_attn,
        fused_swiglu=m.fused_swiglu,
        lean_rmsnorm=lean_rmsnorm(m.lean_rmsnorm, t.recompute),  # fit keeps auto: per row
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
        dropout=m.dropout > 0,
        overlap=par.overlap,
        # theory.sharding's Sharding.sharded and D, which cannot be imported here (it builds on Dims)
        dp_shard=par.dp_shard if par.dp // par.dp_replicate > 1 else "none",
        dp_shards=par.dp // par.dp_replicate if par.dp_shard != "none" else 1,
        zero_bucket=par.zero_bucket_elements or max(40_000_000, 1_000_000 * par.dp),  # bucket_cap
        fused_ops=m.fused_ops,
        fused_loss=m.fused_ops and cfg.launch.device == "cuda" and cfg.launch.emulate != "fake",
        grad_clip=t.grad_clip > 0,
        no_decay=tuple(t.no_decay) if t.weight_decay else (),
        dtensor=par.engine == "dtensor" and T > 1,
    )
