"""Up-front checks that a config can be sharded, raised before any process is launched (and before torch
loads: this module imports none of it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpbench.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, lean_rmsnorm
from tpbench.models.shapes import default_intermediate_size
from tpbench.parallel.names import DROPOUT_FAULTS as FAULTS

if TYPE_CHECKING:
    from tpbench.models.minimind import MiniMindConfig  # torch: these checks run before it loads

# The gradient sums a sharded model needs (debug.skip_grad_sum may leave one out, to prove it is
# needed), for both engines: the q/k norms' weights (each rank sees its heads), the replicated KV
# heads' (megatron only: the DTensor engine refuses fewer KV heads than ranks), the norms' under SP
# (each rank sees its sequence shard), and the DP average.
GRAD_SUMS = ("qk_norm", "kv_replicas", "sp_norms", "dp")


def check_shardable(cfg: RunConfig) -> None:
    """Raise ConfigError if the model cannot be split as the parallel config asks."""
    check_grad_clip(cfg)
    check_dropout(cfg)
    check_accumulation(cfg)
    check_optimizer(cfg)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.tp < 1 or p.dp < 1:
        raise ConfigError(f"parallel.tp={p.tp}, parallel.dp={p.dp}: both must be >= 1")
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by "
            f"model.num_attention_heads={m.num_attention_heads}: accepted are multiples of the head count, "
            f"or model.head_dim given"
        )
    if m.head_dim is None and (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} / model.num_attention_heads={m.num_attention_heads} is an "
            f"odd head dim, which RoPE's rotate-half cannot split: accepted are even head dims"
        )
    if m.head_dim is not None and m.head_dim % 2:
        raise ConfigError(
            f"model.head_dim={m.head_dim} is odd, which RoPE's rotate-half cannot split: accepted are even "
            f"head dims"
        )
    if m.rope_scaling_factor != 1.0 and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(
            f"model.rope_high_freq_factor={m.rope_high_freq_factor} with model.rope_low_freq_factor="
            f"{m.rope_low_freq_factor}: Llama-3.1's RoPE scaling needs high > low"
        )
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(
            f"model.num_key_value_heads={m.num_key_value_heads} does not divide "
            f"model.num_attention_heads={m.num_attention_heads}: accepted are divisors of it"
        )
    if m.num_attention_heads % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide model.num_attention_heads={m.num_attention_heads}: "
            f"accepted are divisors of the head count"
        )
    kv = m.num_key_value_heads
    if kv % p.tp and p.tp % kv:
        raise ConfigError(
            f"parallel.tp={p.tp} with model.num_key_value_heads={kv}: accepted are tp dividing the KV "
            f"heads (sharded) or tp a multiple of them (replicated)"
        )
    if m.intermediate_size is not None and m.intermediate_size % p.tp:
        raise ConfigError(
            f"model.intermediate_size={m.intermediate_size} is not divisible by parallel.tp={p.tp}"
        )
    if m.intermediate_size is None and default_intermediate_size(m.hidden_size) % p.tp:
        raise ConfigError(
            f"model.intermediate_size (default {default_intermediate_size(m.hidden_size)}) is not divisible "
            f"by parallel.tp={p.tp}: set model.intermediate_size"
        )
    if p.sp and t.seq_len % p.tp:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is not divisible by parallel.tp={p.tp}, as sp=true needs"
        )
    if p.engine == "ddp" and (p.tp != 1 or p.sp or p.vp):
        given = [f"tp={p.tp}"] * (p.tp != 1) + ["sp=true"] * p.sp + ["vp=true"] * p.vp
        raise ConfigError(
            f"mode=ddp with {' '.join(given)}: DDP keeps the whole model on every rank; accepted are tp=1, "
            f"sp=false, vp=false (TP with DP: mode=tp dp=N)"
        )
    if p.sp_gather == "linear" and not (p.sp and p.engine == "megatron"):
        raise ConfigError(
            f"parallel.sp_gather=linear with engine={p.engine} sp={str(p.sp).lower()}: it says where SP "
            f"all-gathers a column linear's input; accepted only with engine=megatron and sp=true"
        )
    if t.batch == "fixed_global" and t.global_batch % p.dp:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by parallel.dp={p.dp} under fixed_global"
        )


def check_dropout(cfg: RunConfig) -> None:
    """model.dropout: a probability, and only where each mask can be the dense model's slice.
    train.compile runs it too: a compiled block takes the masks' key as a tensor, so a new step
    recompiles nothing (tpbench.models.dropout.DropoutKey)."""
    m, p = cfg.model, cfg.parallel
    if not (0.0 <= m.dropout < 1.0):  # also refuses nan
        raise ConfigError(f"model.dropout={m.dropout}: accepted are probabilities in [0, 1)")
    if cfg.debug.dropout_fault not in ("", *FAULTS):
        accepted = ", ".join(map(repr, ("", *FAULTS)))
        raise ConfigError(f"debug.dropout_fault={cfg.debug.dropout_fault!r}: accepted are {accepted}")
    if cfg.debug.dropout_fault and m.dropout == 0.0:
        raise ConfigError(
            f"debug.dropout_fault={cfg.debug.dropout_fault}: breaks the dropouts' offsets, accepted with "
            "model.dropout > 0"
        )
    if m.dropout == 0.0:
        return
    blocked = [
        (
            m.flash_attn,
            "model.flash_attn=true (SDPA draws its own mask, not one keyed by position)",
            "model.flash_attn=false",
        ),
        (
            p.engine == "dtensor",
            "parallel.engine=dtensor (its plan tells no dropout where its shard sits)",
            "parallel.engine=megatron or ddp",
        ),
    ]
    for bad, what, accepted in blocked:
        if bad:
            raise ConfigError(f"model.dropout={m.dropout} with {what}: accepted is {accepted}")


NO_DECAY = ("norms", "biases", "embeddings")  # train.no_decay (tpbench.experiments.optim)
DECAY_TYPES = ("linear", "sqrt", "cosine")  # train.lr_scheduler.decay_type, torchtitan's
OPTIM_FAULTS = ("decay_norm", "lr_ahead")  # debug.optim_fault


def check_optimizer(cfg: RunConfig) -> None:
    """train.no_decay, train.lr_scheduler and debug.optim_fault take what tpbench.experiments.optim
    knows."""
    t, s = cfg.train, cfg.train.lr_scheduler
    unknown = [k for k in t.no_decay if k not in NO_DECAY]
    if unknown:
        raise ConfigError(
            f"train.no_decay={t.no_decay}: {unknown[0]!r} is unknown, accepted are {list(NO_DECAY)}"
        )
    if s.decay_type not in DECAY_TYPES:
        raise ConfigError(
            f"train.lr_scheduler.decay_type={s.decay_type!r}: accepted are {', '.join(DECAY_TYPES)}"
        )
    if s.warmup_steps < 0:
        raise ConfigError(f"train.lr_scheduler.warmup_steps={s.warmup_steps}: accepted are steps >= 0")
    if s.decay_ratio is not None and not 0.0 <= s.decay_ratio <= 1.0:
        raise ConfigError(f"train.lr_scheduler.decay_ratio={s.decay_ratio}: accepted are null or [0, 1]")
    if not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError(f"train.lr_scheduler.min_lr_factor={s.min_lr_factor}: accepted are [0, 1]")
    fault = cfg.debug.optim_fault
    if fault not in ("", *OPTIM_FAULTS):
        accepted = ", ".join(map(repr, ("", *OPTIM_FAULTS)))
        raise ConfigError(f"debug.optim_fault={fault!r}: accepted are {accepted}")
    # a fault where it changes nothing would be a planted bug that plants none
    if fault == "decay_norm" and not (t.weight_decay and "norms" in t.no_decay):
        raise ConfigError(
            f"debug.optim_fault=decay_norm with train.weight_decay={t.weight_decay:g} and train.no_decay="
            f"{list(t.no_decay)}: decays model.norm.weight where no_decay exempts it, accepted with "
            "train.weight_decay > 0 and norms in train.no_decay"
        )
    if fault == "lr_ahead" and s.constant():
        raise ConfigError(
            "debug.optim_fault=lr_ahead with a constant lr (train.lr_scheduler.warmup_steps=0, "
            "decay_ratio=0): runs the lr schedule a step ahead, accepted with warmup_steps > 0 or "
            "decay_ratio != 0"
        )


def check_dtensor_shardable(model: ModelConfig | MiniMindConfig, pcfg: ParallelConfig) -> None:
    """Raise ConfigError (one line) for what this engine cannot express; callable before launch."""
    tp, kv = pcfg.tp, model.num_key_value_heads
    if pcfg.engine != "dtensor" or tp == 1:
        return
    if kv % tp:
        raise ConfigError(
            f"parallel.engine=dtensor with model.num_key_value_heads={kv}, parallel.tp={tp}: accepted are "
            f"tp dividing the KV heads (ColwiseParallel cannot replicate them)"
        )
    if pcfg.vp and model.vocab_size % tp:
        raise ConfigError(
            f"parallel.engine=dtensor vp=true with model.vocab_size={model.vocab_size}: accepted are vocab "
            f"sizes divisible by parallel.tp={tp} (this engine does not pad the vocab)"
        )


SHARD_FAULTS = ("no_reduce_scatter", "no_all_gather")  # debug.shard_fault, for every sharded level
ZERO1_FAULTS = ("early_reduce_scatter",)  # debug.shard_fault, ZeRO-1's buckets only


def check_accumulation(cfg: RunConfig) -> None:
    """Raise ConfigError (one line) for gradient accumulation (train.accumulation > 1) where a step's
    micro-batches cannot be taken apart as the whole batch would be."""
    k, p = cfg.train.accumulation, cfg.parallel
    if k == 1:
        return
    if cfg.model.dropout > 0:
        raise ConfigError(
            f"train.accumulation={k} with model.dropout={cfg.model.dropout}: the dropout masks are drawn "
            "per DP slice, not per micro-batch; accepted are model.dropout=0 or train.accumulation=1"
        )
    if p.overlap and p.engine == "megatron" and p.dp > 1 and p.dp_shard == "none":
        raise ConfigError(
            f"train.accumulation={k} with parallel.overlap=true and parallel.dp={p.dp}: overlap's flat DP "
            "buckets all-reduce during every backward; accepted are parallel.overlap=false, "
            "parallel.dp_shard=optimizer, or train.accumulation=1"
        )


CLIP_FAULTS = ("double_count", "nonfinite")  # debug.clip_fault (tpbench.parallel.clip)


def check_grad_clip(cfg: RunConfig) -> None:
    """Raise ConfigError (one line) for train.grad_clip, train.grad_clip_nonfinite or debug.clip_fault
    that cannot act as asked."""
    t, fault = cfg.train, cfg.debug.clip_fault
    if not 0 <= t.grad_clip < float("inf"):
        raise ConfigError(f"train.grad_clip={t.grad_clip}: accepted are a finite max norm > 0, or 0 (off)")
    if t.grad_clip_nonfinite not in ("error", "skip"):
        raise ConfigError(
            f"train.grad_clip_nonfinite={t.grad_clip_nonfinite!r}: accepted are 'error', 'skip'"
        )
    if fault not in ("", *CLIP_FAULTS):
        accepted = ", ".join(map(repr, ("", *CLIP_FAULTS)))
        raise ConfigError(f"debug.clip_fault={fault!r}: accepted are {accepted}")
    if fault and t.grad_clip <= 0:
        raise ConfigError(
            f"debug.clip_fault={fault} with train.grad_clip=0: breaks the clipping, set a max norm"
        )
    if fault == "double_count" and (cfg.kind != "validate" or cfg.parallel.tp < 2):
        raise ConfigError(
            f"debug.clip_fault=double_count with kind={cfg.kind}, tp={cfg.parallel.tp}: counts a replicated "
            "parameter on every TP rank, accepted with kind=validate and tp >= 2"
        )
    if fault == "nonfinite" and cfg.kind == "validate":
        raise ConfigError(
            "debug.clip_fault=nonfinite with kind=validate: fails or skips a training step, accepted with "
            "kind=memory or throughput"
        )


def check_dp_shard(cfg: RunConfig) -> None:
    """Raise ConfigError (one line) for a sharded DP level (parallel.dp_shard, dp_replicate) that
    cannot run as asked; callable before launch."""
    p, d = cfg.parallel, cfg.debug
    level = p.dp_shard
    if d.shard_fault not in ("", *SHARD_FAULTS, *ZERO1_FAULTS):
        accepted = ", ".join(map(repr, ("", *SHARD_FAULTS, *ZERO1_FAULTS)))
        raise ConfigError(f"debug.shard_fault={d.shard_fault!r}: accepted are {accepted}")
    if d.shard_fault and level == "none":
        raise ConfigError(
            f"debug.shard_fault={d.shard_fault}: breaks a sharded DP level, accepted with "
            "parallel.dp_shard=optimizer, grads or full"
        )
    if d.shard_fault in ZERO1_FAULTS and level != "optimizer":
        raise ConfigError(
            f"debug.shard_fault={d.shard_fault} with parallel.dp_shard={level}: breaks ZeRO-1's buckets, "
            "accepted with parallel.dp_shard=optimizer"
        )
    if p.dp_replicate < 1 or p.dp % p.dp_replicate:
        raise ConfigError(
            f"parallel.dp_replicate={p.dp_replicate} with parallel.dp={p.dp}: accepted are divisors of dp"
        )
    if p.dp_replicate > 1 and (level not in ("grads", "full") or p.dp // p.dp_replicate < 2):
        raise ConfigError(
            f"parallel.dp_replicate={p.dp_replicate} with dp_shard={level}, dp={p.dp}: HSDP replicates "
            "FSDP2's shards, accepted with dp_shard=grads or full and dp / dp_replicate >= 2"
        )
    if level == "none":
        return
    blocked = [
        (p.dp == 1, "parallel.dp=1 (nothing to shard over)", "parallel.dp >= 2"),
        (
            p.engine == "dtensor" and level == "optimizer",
            "parallel.engine=dtensor (ZeRO-1 is built over the megatron and ddp engines' plain tensors)",
            "dp_shard=grads or full there",
        ),
        (bool(d.ddp_fault), f"debug.ddp_fault={d.ddp_fault} (no DDP runs)", "debug.ddp_fault unset"),
        (
            d.overlap_fault == "early_bucket",
            "debug.overlap_fault=early_bucket (no DP buckets: the gradients are reduce-scattered)",
            "debug.overlap_fault unset or no_wait",
        ),
        ("dp" in d.skip_grad_sum, "debug.skip_grad_sum=dp (use debug.shard_fault)", "the other sums"),
        (d.grad_scale != 1.0, f"debug.grad_scale={d.grad_scale}", "debug.grad_scale=1"),
    ]
    for bad, what, accepted in blocked:
        if bad:
            raise ConfigError(f"parallel.dp_shard={level} with {what}: accepted is {accepted}")


AUTO_SWITCHES = ("train.compile", "train.fused_optimizer", "model.lean_rmsnorm")  # auto | true | false
COMPILE_BACKENDS = ("inductor", "aot_eager")  # train.compile_backend (tpbench.parallel.compiled)
COMPILED_KINDS = ("throughput", "validate")  # kind=memory runs eager: the memory model counts eager tensors


def check_compile(cfg: RunConfig) -> None:
    """train.compile, train.fused_optimizer and model.lean_rmsnorm take auto, true or false;
    compile=true is refused, with why, where a compiled block cannot run (`compile_refusal`)."""
    for key in AUTO_SWITCHES:
        group, _, name = key.partition(".")
        value = getattr(getattr(cfg, group), name)
        if not (value is True or value is False or value == "auto"):
            raise ConfigError(f"{key}={value}: accepted are auto, true, false")
    if cfg.train.compile_backend not in COMPILE_BACKENDS:
        accepted = ", ".join(COMPILE_BACKENDS)
        raise ConfigError(f"train.compile_backend={cfg.train.compile_backend!r}: accepted are {accepted}")
    refused = compile_refusal(cfg)
    if cfg.train.compile is True and refused is not None:
        what, accepted = refused
        raise ConfigError(f"train.compile=true with {what}: accepted is {accepted}")


def compile_refusal(cfg: RunConfig) -> tuple[str, str] | None:
    """What keeps this run's blocks from compiling and what is accepted instead; None: nothing."""
    p = cfg.parallel
    if p.sp and p.tp > 1 and p.sp_regather and not p.overlap:
        return (
            "parallel.sp_regather=true (SP's re-gather saves through saved_tensors_hooks, a graph break)"
            " and parallel.overlap=false",
            "parallel.sp_regather=false, or parallel.overlap=true",
        )
    if cfg.launch.emulate != "none":
        return f"launch.emulate={cfg.launch.emulate}", "launch.emulate=none"
    if p.engine == "dtensor" and p.vp and p.tp > 1:  # torch 2.13, on a CPU with aot_eager (measured)
        return (
            "parallel.engine=dtensor and parallel.vp=true (the compiled blocks' backward hands the VP "
            "embedding's redistribution a plain gradient: AttributeError in DTensor's Redistribute)",
            "parallel.vp=false, or parallel.engine=megatron",
        )
    if p.engine == "dtensor" and cfg.train.recompute == "full" and p.tp > 1:  # torch 2.13 (measured)
        return (
            "parallel.engine=dtensor and train.recompute=full (a compiled checkpoint of a DTensor block "
            "saves its DeviceMesh, which torch's checkpoint refuses)",
            "train.recompute=op or selective",
        )
    return None


def resolve_switches(cfg: RunConfig) -> None:
    """train.compile=auto: on for a CUDA run of kind throughput or validate that can compile, off
    elsewhere; kind=memory runs eager whatever it says (the memory model counts eager tensors).
    train.fused_optimizer=auto: fused on CUDA (as torchtitan trains) and wherever the blocks compile
    (a CPU run asked to: AdamW's one fused op, not its per-parameter loop, beside the compiled blocks),
    torch's default on a CPU otherwise.
    model.lean_rmsnorm=auto: the input-only norm where train.recompute asks for memory, torch's
    norm without its checkpoint otherwise (tpbench.config.lean_rmsnorm).
    All become true or false, the values recorded runs hold: their identities stay (config_hash)."""
    cfg.model.lean_rmsnorm = lean_rmsnorm(cfg.model.lean_rmsnorm, cfg.train.recompute)
    t, cuda = cfg.train, cfg.launch.device == "cuda"
    if t.compile == "auto":
        t.compile = cuda and cfg.kind in COMPILED_KINDS and compile_refusal(cfg) is None
    if cfg.kind not in COMPILED_KINDS:
        t.compile = False
    if t.fused_optimizer == "auto":
        t.fused_optimizer = cuda or t.compile is True
