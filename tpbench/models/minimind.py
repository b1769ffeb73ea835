"""Dense MiniMind: a small Qwen3-style decoder, in plain PyTorch, with the switches that make it Llama,
Qwen2.5 or Qwen3 (qk_norm, head_dim, attention_bias, Llama-3.1's RoPE scaling).

Follows jingyaogong/minimind `model/model_minimind.py` (parameter names included, so a MiniMind state
dict loads as it is; they are also transformers' names for LlamaForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM, whose outputs tests/test_families.py matches). Batch-first at the edges ([B, S] ids
in, [B, S, V] logits out); inside, the hidden stream is sequence-first [S, B, H] so that sequence
parallelism splits dim 0 without transposes.

This file knows nothing of parallelism: tpbench.parallel.plan shards it by swapping layers in.
Shapes in comments: S sequence, B batch, H hidden, N heads, D head dim, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tpbench.models.dropout import PROBS_DIMS, SITES, STREAM_DIMS, DropoutKey, PositionalDropout
from tpbench.models.shapes import default_intermediate_size

IGNORE_INDEX = -100
# the torch dtype of each train.dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MiniMindConfig:
    hidden_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 6400
    intermediate_size: int | None = None
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    qk_norm: bool = True  # RMSNorm of each query and key head before RoPE (Qwen3, MiniMind)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    attention_bias: bool = False  # q, k, v with biases (Qwen2.5); o_proj never has one
    rope_scaling_factor: float = 1.0  # Llama-3.1's rope_scaling (rope_type llama3); 1.0: none
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    flash_attn: bool = True
    fused_swiglu: bool = True  # keep gate and up only; False: MiniMind's silu and mul, as autograd saves
    lean_rmsnorm: bool = True  # RMSNorm keeps its input only; False: its fp32 internals, as autograd saves
    # torch's fused ops where they are the same math: F.rms_norm, GQA inside SDPA, RoPE tables in the
    # compute dtype made once, the loss's log-softmax upcast inside; False: MiniMind's own ops (the seed's)
    fused_ops: bool = True
    # MiniMind's four dropouts (embedding output, attention probabilities, after o_proj, after down_proj),
    # each mask a hash of the element's position (tpbench.models.dropout); needs the manual attention
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout}: accepted are probabilities in [0, 1)")
        if self.dropout > 0 and self.flash_attn:
            raise ValueError(
                f"dropout={self.dropout} with flash_attn=True: SDPA draws its own attention mask, not "
                "one keyed by position; accepted is flash_attn=False"
            )
        if self.intermediate_size is None:
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def rope_frequencies(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[D/2] inverse frequencies of RoPE, scaled as Llama-3.1 scales them (transformers'
        rope_type llama3) when rope_scaling_factor != 1: long wavelengths divided by the factor,
        short ones kept, those between blended."""
        d = self.head_dim
        freqs = 1.0 / (self.rope_theta ** (torch.arange(0, d // 2 * 2, 2, device=device).float() / d))
        if self.rope_scaling_factor == 1.0:
            return freqs
        factor, low, high = self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor
        context = self.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > context / low, freqs / factor, freqs)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return torch.where(medium, blended, scaled)


class RMSNorm(nn.Module):
    """Normalises and scales in fp32, then casts back to the input dtype, as MiniMind does
    (`(weight * norm(x.float())).type_as(x)`): in bf16 its ops keep two fp32 copies of x's shape for
    backward (x.float(), which pow and mul save, and the normalised result, which the weight's mul
    saves) and an fp32 rsqrt per row.

    fused (model.fused_ops) calls torch's F.rms_norm instead, the same math: on CUDA one kernel each
    way, keeping x and an fp32 rsqrt per row; on this torch's CPU it decomposes into the very ops
    above (mean's result plus eps in place), so it keeps what they keep.

    keep_input_only (model.lean_rmsnorm) keeps x alone and runs the same ops again at the start of the
    norm's backward (torch.utils.checkpoint): the same autograd graph, so the same gradients bit for
    bit, for 2 bytes per element kept instead of 8 in bf16 (4 instead of 8 in fp32; in fp32, x.float()
    is x)."""

    def __init__(self, dim: int, eps: float = 1e-6, keep_input_only: bool = False, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.keep_input_only = keep_input_only
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_input_only:
            return checkpoint(self._norm, x, use_reentrant=False, preserve_rng_state=False)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == self.weight.dtype:  # else (autocast's q, k) torch decomposes it too
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32, or fp64 for validation's reference
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).type_as(x)


def rope_tables(
    cfg: MiniMindConfig, seq_len: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [S, D]: the frequency table concatenated twice (rotate-half form), made on
    `device` (no copy from the host)."""
    freqs = cfg.rope_frequencies(device)  # [D/2]
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)  # [S, D/2]
    emb = torch.cat([angles, angles], dim=-1)  # [S, D]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [S, B, N, D]; cos, sin [S, D] -> broadcast over B and N
    cos, sin = cos.view(cos.shape[0], 1, 1, -1).to(x.dtype), sin.view(sin.shape[0], 1, 1, -1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def fused_rope_tables(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, D] fp32 cos, sin -> [S, 1, 1, D] cos and sign-folded sin in `dtype`, cast once: rounded as
    apply_rope rounds them at each call. The sine's first half negated, so that rotate_half's neg
    and cat become one flip of x's halves (x2 * -sin1 is -x2 * sin1 bit for bit)."""
    half = sin.shape[-1] // 2
    signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos[:, None, None, :].to(dtype), signed[:, None, None, :].to(dtype)


def apply_fused_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """apply_rope's result, bit for bit, in 4 ops instead of 5 and no per-call cast: x [S, B, N, D];
    cos, signed_sin [S, 1, 1, D] from fused_rope_tables."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * signed_sin


def dropout(cfg: MiniMindConfig, key: DropoutKey, layer: int, site: str) -> PositionalDropout | None:
    """The dropout of block `layer`'s `site` (SITES; layer -1, site "embedding": the embedding's), or
    None without dropout (the model then has no such module)."""
    if cfg.dropout == 0.0:
        return None
    number = 0 if layer < 0 else 1 + layer * len(SITES) + SITES.index(site)
    return PositionalDropout(cfg.dropout, number, PROBS_DIMS if site == "attention" else STREAM_DIMS, key)


def drop(module: PositionalDropout | None, x: torch.Tensor) -> torch.Tensor:
    return x if module is None else module(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # [S, B, N_kv, D] -> [S, B, N_kv * n_rep, D]
    if n_rep == 1:
        return x
    s, b, n_kv, d = x.shape
    return x.unsqueeze(3).expand(s, b, n_kv, n_rep, d).reshape(s, b, n_kv * n_rep, d)


class Attention(nn.Module):
    """GQA attention. Head counts are read off the projections' outputs, so a tensor-parallel plan
    that shards q/k/v by heads needs no change here."""

    def __init__(self, cfg: MiniMindConfig, key: DropoutKey | None = None, layer: int = 0):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.flash = cfg.flash_attn
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=bias)  # weight [Nq D, H]
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=bias)  # weight [Nkv D, H]
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)  # weight [H, Nq D]
        self.qk_norm = cfg.qk_norm
        self.fused = cfg.fused_ops
        if cfg.qk_norm:  # off (Llama, Qwen2.5): no such parameters at all
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.lean_rmsnorm, cfg.fused_ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.lean_rmsnorm, cfg.fused_ops)
        key = key or DropoutKey()
        self.attn_dropout = dropout(cfg, key, layer, "attention")  # [B, N, S, S]: split by heads
        self.resid_dropout = dropout(cfg, key, layer, "attention_output")  # [S(/T), B, H]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        q = self.q_proj(x)  # [S, B, Nq D]; x may be SP's shard [S/T, B, H] that q_proj all-gathers
        s, b, _ = q.shape
        q = q.view(s, b, -1, d)  # [S, B, Nq, D]
        k = self.k_proj(x).view(s, b, -1, d)  # [S, B, Nkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(s, b, -1, d)  # [S, B, Nkv, D]
        if self.fused:  # tables made once in the compute dtype (a cast here only if q's dtype differs)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            q, k = apply_fused_rope(q, cos, sin), apply_fused_rope(k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.flash and self.fused  # SDPA takes the KV heads as they are
        if not gqa:  # manual attention's matmuls need as many KV heads as query heads: a copy
            n_rep = q.shape[2] // k.shape[2]
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, N, S, D] (k, v: [B, Nkv, S, D] if gqa)
        if self.flash:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)  # [B, N, S, S]
            causal = torch.full((s, s), float("-inf"), device=x.device).triu(1)
            probs = F.softmax(scores.float() + causal, dim=-1).type_as(q)
            out = drop(self.attn_dropout, probs) @ v  # [B, N, S, D]
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [S, B, N*D]
        return drop(self.resid_dropout, self.o_proj(out))  # [S, B, H]; SP: the shard [S/T, B, H]


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: MiniMindConfig, key: DropoutKey | None = None, layer: int = 0):
        super().__init__()
        self.fused = cfg.fused_swiglu
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.dropout = dropout(cfg, key or DropoutKey(), layer, "mlp_output")  # [S(/T), B, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop(self.dropout, self.down_proj(self.act(self.gate_proj(x), self.up_proj(x))))

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, between the projections (under train.compile with parallel.overlap, a
        compiled region of its own)."""
        return swiglu(gate, up) if self.fused else F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, keeping gate and up only for backward: silu(gate) is made again there (one
    elementwise op) instead of being kept, as Megatron's fused SwiGLU keeps its input alone. The
    gradients are those autograd makes of the two ops, bit for bit."""
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        grad_up = F.silu(gate).mul_(grad)  # in its own buffer: 3 tensors of the size live at once
        return grad_gate, grad_up


class MiniMindBlock(nn.Module):
    def __init__(self, cfg: MiniMindConfig, key: DropoutKey | None = None, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, key, layer)
        self.mlp = FeedForward(cfg, key, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.lean_rmsnorm, cfg.fused_ops)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, cfg.lean_rmsnorm, cfg.fused_ops
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class MiniMindModel(nn.Module):
    """The decoder. Its dropouts share one DropoutKey, whose step advances at each forward in
    training mode: a block recomputed in backward draws its forward's masks again."""

    def __init__(self, cfg: MiniMindConfig):
        super().__init__()
        self.dropout_key = DropoutKey()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.dropout = dropout(cfg, self.dropout_key, -1, "embedding")  # [S(/T), B, H]
        blocks = (MiniMindBlock(cfg, self.dropout_key, i) for i in range(cfg.num_hidden_layers))
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.lean_rmsnorm, cfg.fused_ops)
        self.config = cfg
        self.rope_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        # model.fused_ops: the fp32 tables it was made from and fused_rope_tables' result
        self.fused_rope: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]] | None = None

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, D] in fp32, built once per length and device, not on the CPU at every step."""
        key = (seq_len, device)
        if key not in self.rope_cache:
            self.rope_cache[key] = rope_tables(self.config, seq_len, device)
        return self.rope_cache[key]

    def rope_in(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """model.fused_ops: fused_rope_tables of these fp32 tables in `dtype`, made again only when the
        tables or the dtype change (a planted fault may hand new tables at each step)."""
        made = self.fused_rope
        if made is None or made[0][0] is not cos or made[0][1] is not sin or made[1][0].dtype != dtype:
            self.fused_rope = made = ((cos, sin), fused_rope_tables(cos, sin, dtype))
        return made[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(input_ids.shape[1], input_ids.device)
        if self.training:
            self.dropout_key.step += 1
        x = drop(self.dropout, self.embed_tokens(input_ids.t()))  # [S, B, H]; SP: [S/T, B, H]
        if self.config.fused_ops:  # the dtype q, k will have: autocast's, else the stream's
            kind = x.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
            cos, sin = self.rope_in(cos, sin, dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)  # [S, B, H]


class CausalLMLoss(nn.Module):
    """Cross entropy of logits[s] against labels[s + 1], ignore_index -100, mean over valid tokens,
    in fp32 (fp64: validation's reference). fused: the log-softmax reads the 16-bit logits and writes
    fp32 (its backward the 16-bit gradient), the same bits without a whole fp32 copy of the logits."""

    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits [S, B, V], targets [S, B] already shifted
        wide = torch.promote_types(logits.dtype, torch.float32)
        flat, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)  # [S B, V], [S B]
        if self.fused:
            return F.nll_loss(torch.log_softmax(flat, -1, dtype=wide), targets, ignore_index=IGNORE_INDEX)
        return F.cross_entropy(flat.to(wide), targets, ignore_index=IGNORE_INDEX)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels -> [S, B] targets: position s predicts token s + 1; the last predicts nothing."""
    shifted = F.pad(labels.narrow(1, 1, labels.shape[1] - 1), (0, 1), value=IGNORE_INDEX)  # [B, S]
    return shifted.t().contiguous()


class MiniMindForCausalLM(nn.Module):
    def __init__(self, cfg: MiniMindConfig):
        super().__init__()
        self.config = cfg
        self.model = MiniMindModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = CausalLMLoss(cfg.fused_ops)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits [B, S, V], loss or None)."""
        logits = self.lm_head(self.model(input_ids))  # [S, B, V]
        loss = None if labels is None else self.loss_fn(logits, shift_labels(labels))
        return logits.transpose(0, 1), loss


def build_model(cfg: MiniMindConfig, seed: int = 0) -> MiniMindForCausalLM:
    """The dense model, initialised from one seed (normal(0, 0.02) linears, their biases (not zero, so
    that a misplaced bias shows in the first forward) and embeddings); its dropouts keyed by the same
    seed."""
    gen = torch.Generator().manual_seed(seed)
    model = MiniMindForCausalLM(cfg)
    model.model.dropout_key.seed = seed
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model
