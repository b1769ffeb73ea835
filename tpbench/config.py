"""The typed schema of one tpbench run.

Hydra composes `conf/` into this schema (registered in the ConfigStore); every worker receives the
resolved config as a YAML file and turns it back into a `RunConfig` with `load_run_config`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tpbench.labels import LEVEL_NAMES, dp_level_label, emulation_label, layout_label  # noqa: F401

# conf/ sits next to the package: the groups Hydra composes into a RunConfig.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(ValueError):
    """One line naming the bad value and what is accepted."""


# Short names for the keys people type most; any full key of `tpbench run --cfg` works as well.
SHORT_NAMES = {
    "tp": "parallel.tp", "dp": "parallel.dp", "sp": "parallel.sp", "vp": "parallel.vp",
    "engine": "parallel.engine", "layers": "model.num_hidden_layers", "hidden": "model.hidden_size",
    "heads": "model.num_attention_heads", "kv_heads": "model.num_key_value_heads",
    "vocab": "model.vocab_size", "seq": "train.seq_len", "micro_batch": "train.micro_batch",
    "accumulation": "train.accumulation", "global_batch": "train.global_batch", "steps": "train.steps",
    "dtype": "train.dtype", "precision": "train.precision", "recompute": "train.recompute",
    "compile": "train.compile", "overlap": "parallel.overlap", "dp_shard": "parallel.dp_shard",
    "dp_replicate": "parallel.dp_replicate"
}  # fmt: skip


@dataclass
class ModelConfig:
    """MiniMind's fields (see tpbench.models.minimind.MiniMindConfig) plus a preset name."""

    name: str = "tiny"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 256
    intermediate_size: int | None = None  # None: ceil(H * pi / 64) * 64, as MiniMind
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    qk_norm: bool = True  # RMSNorm of each q and k head before RoPE (Qwen3, MiniMind); off: Llama, Qwen2.5
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    attention_bias: bool = False  # q, k, v with biases (Qwen2.5); o_proj never has one
    rope_scaling_factor: float = 1.0  # Llama-3.1's rope_scaling "factor"; 1.0: none (changes no shape)
    # Llama-3.1's rope_scaling (rope_type llama3), read only when rope_scaling_factor != 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    flash_attn: bool = True  # SDPA; False: manual attention with an fp32 softmax
    # True: SwiGLU keeps gate and up only (silu(gate) made again in backward, as Megatron's fused
    # SwiGLU); False: MiniMind's own two ops, which keep silu(gate) too: the seed's benchmark model
    fused_swiglu: bool = True
    # True: each RMSNorm keeps its input only and remakes its fp32 internals in backward (the same
    # ops again: the gradients bit for bit; a checkpoint per norm, more dispatches in backward); False:
    # the norm's ops as autograd saves them (two fp32 copies of the input's shape per norm unfused:
    # the seed's benchmark model). auto | true | false; auto: true where train.recompute asks for
    # memory (selective or full: false is refused there), false with train.recompute=none
    # (`lean_rmsnorm`; resolved before a run by tpbench.parallel.checks.resolve_switches)
    lean_rmsnorm: Any = "auto"
    # True: torch's fused ops where they are the same math (F.rms_norm, GQA inside SDPA, RoPE tables in
    # the compute dtype made once, the loss upcast inside cross-entropy): fewer host dispatches;
    # False: MiniMind's own ops, as the seed's published figures were measured
    fused_ops: bool = True
    # MiniMind's dropouts (embedding output, attention probabilities, after o_proj and down_proj), each
    # mask a hash of (train.seed, step, site, the element's dense position): TP, SP, VP, DP and
    # recompute draw the dense model's masks (tpbench.models.dropout); needs flash_attn=false
    dropout: float = 0.0
    # a Hugging Face config.json (or a folder holding one) that the fields above were read from
    # (tpbench.models.hf_config); "": none. Where the shape came from, not what is measured: not hashed
    hf_config: str = ""


@dataclass
class ParallelConfig:
    tp: int = 2
    dp: int = 1
    sp: bool = False
    vp: bool = False
    engine: str = "megatron"  # megatron (ours) | ddp (torch DDP, tp must be 1) | dtensor
    sp_regather: bool = True  # SP keeps only the local shard for backward and all-gathers again
    # SP's all-gather granularity: region (one per attention / MLP input, its linears share the
    # gathered tensor) | linear (each column-parallel linear gathers its own input, as minimind-tron)
    sp_gather: str = "region"
    vocab_pad_multiple: int = 1  # VP pads V up to a multiple of tp * vocab_pad_multiple
    # Megatron's async TP: backward collectives run while compute goes on (tpbench.parallel.overlap);
    # engine megatron only (DDP always overlaps its buckets, DTensor has no such switch)
    overlap: bool = False
    ddp_bucket_mb: float = 25.0  # DDP's bucket cap, and the DP buckets of megatron with overlap=true
    ddp_gradient_as_bucket_view: bool = True
    # sharded data parallelism over each TP rank's DP group: none (DDP replicas) | optimizer (ZeRO-1:
    # fp32 master and AdamW moments split over DP) | grads (ZeRO-2, FSDP2 reshard_after_forward=False)
    # | full (ZeRO-3, FSDP2's default: weights gathered per block for forward and again for backward)
    dp_shard: str = "none"
    # ZeRO-1's buckets (tpbench.parallel.zero), in elements: each bucket of the flat buffers is closed at
    # a parameter boundary once it holds this many; 0: Megatron's default, max(40M, 1M x dp)
    zero_bucket_elements: int = 0
    # HSDP: shard within groups of dp / dp_replicate ranks, replicate across the dp_replicate groups
    dp_replicate: int = 1


@dataclass
class LRSchedulerConfig:
    """train.lr_scheduler, torchtitan's (tpbench.experiments.optim); the defaults keep the lr constant."""

    warmup_steps: int = 0  # linear warm-up steps
    decay_ratio: float | None = 0.0  # the share of the steps that decay, the last; None: all after warm-up
    decay_type: str = "linear"  # linear | sqrt | cosine
    min_lr_factor: float = 0.0  # the lr decays to train.lr x this

    def constant(self) -> bool:
        return self.warmup_steps == 0 and self.decay_ratio == 0


@dataclass
class TrainConfig:
    seq_len: int = 32
    micro_batch: int = 2  # fixed_per_rank: per DP rank (per TP group)
    global_batch: int = 4  # fixed_global: split over the DP ranks
    # gradient accumulation: a step is this many micro-batches (of the batch policy's size) per DP rank,
    # their losses averaged as one batch K times as large would, then one DP gradient sync (DDP, ZeRO-1,
    # FSDP2 alike) and one optimizer step (tpbench.experiments.training.micro_batches)
    accumulation: int = 1
    batch: str = "fixed_per_rank"  # fixed_per_rank | fixed_global
    dtype: str = "float32"  # float32 | bfloat16 | float16
    precision: str = "pure"  # pure: everything in dtype | mixed: fp32 master + autocast(dtype)
    # what memory and throughput train on: cross_entropy (the model's loss) | logits_mean (the seed
    # chapter's memory benchmark: logits.float().mean(), no labels)
    loss: str = "cross_entropy"
    # keep the model's output (the logits, the final hidden states) alive through backward and the
    # optimizer step, as the seed's and minimind-tron's steps (`output = model(...)`); false: dropped
    keep_output: bool = False
    recompute: str = "none"  # none | selective | op | full: activation recompute (tpbench.parallel.recompute)
    lr: float = 1e-3
    weight_decay: float = 0.0  # AdamW's decoupled weight decay of the decayed group
    # left undecayed (tpbench.experiments.optim): any of norms, biases, embeddings; Megatron's [norms, biases]
    no_decay: list[str] = field(default_factory=list)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    # auto | true | false, auto resolved with the device (tpbench.parallel.checks.resolve_switches).
    # AdamW's fused kernel instead of torch's default (foreach on CUDA); auto: fused on CUDA
    fused_optimizer: Any = "auto"
    # torch.compile of each transformer block (inductor, fullgraph), as torchtitan (parallel.compiled);
    # auto: on for CUDA throughput and validate runs; kind=memory runs eager (the memory model's tensors)
    compile: Any = "auto"
    # what each compiled block goes to (torchtitan's compile.backend): inductor (generated kernels) |
    # aot_eager (Dynamo's graph split by AOTAutograd into forward and backward, run by eager kernels:
    # no code generated, to tell a tracing bug from a code-generation one; the tests' variations use it)
    compile_backend: str = "inductor"
    steps: int = 5  # measured steps (memory, throughput)
    warmup: int = 2  # steps before measuring; memory takes at least the steady state (1, DDP 2)
    seed: int = 0
    # the gradients' global norm clipped to this (torch's clip_grad_norm_ over the whole model, TP, SP
    # and DP shards summed, a replicated parameter counted once: tpbench.parallel.clip); 0: off. The
    # published models' presets (conf/model/) set 1.0, torchtitan's and Megatron's default
    grad_clip: float = 0.0
    # a non-finite global norm under grad_clip: error (the run fails, as torch's error_if_nonfinite) |
    # skip (the optimizer step is skipped and counted, as Megatron skips an overflowed step)
    grad_clip_nonfinite: str = "error"


@dataclass
class ValidateConfig:
    steps: int = 20  # AdamW steps compared against dense
    every: int = 5  # compare logits every k steps (and at the last)
    # what the AdamW steps train on: fresh (a new batch every step, the logits compared on one more
    # batch kept aside) | fixed (the seed chapter's check: every step on the forward check's batch,
    # the logits compared on that same batch)
    batch: str = "fresh"
    # MiniMind's pretraining learning rate. At 1e-3 the seed's check config itself turns chaotic after
    # ~120 AdamW steps, and any two fp32 summation orders (dense vs T=4) drift apart by ~1e-2.
    lr: float = 5e-4
    # How many times the run's own rounding drift a check may be off (tpbench.experiments.criterion:
    # why 4)
    k: float = 4.0
    # The floors: each check's bound is K x the dense model's own drift against the reference model
    # (fp64 for an fp32 run, fp32 for bf16 and mixed) + its floor (tpbench.experiments.criterion).
    # A floor is a difference too small to mean anything: it passes even where the reference is 0.
    tol_fwd: float = 1e-5  # max |logits diff|
    tol_loss: float = 1e-5
    tol_grad_rel: float = 1e-5  # each parameter's gradient relative L2
    # each parameter after the AdamW steps: ||sharded - dense|| / ||dense - initial||, the part of its
    # update that differs. Not a max |param diff|: a weight whose gradient is about 0 moves by about
    # lr a step in a direction that rounding sets (3e-3 after 20 steps on a correct Llama shape)
    tol_param: float = 1e-3
    # max |logits diff| at any compared AdamW step (the drift's worst). A bound of its own, since the
    # final parameters show only the end: on the seed's check (+preset=seed_check) the logits drifted
    # up to 2.2e-4 at step 40 (tp_vp; tp 1.9e-4) and settled to 0.8-1.1e-4 by step 200, the final
    # parameters 2.1e-5 apart. 2e-3: 9x that, above the 1.3e-3 the seed chapter accepts over its run
    tol_drift: float = 2e-3


@dataclass
class SlurmConfig:
    """launcher=slurm: each run one Slurm job of launch.nnodes nodes (see tpbench.run.slurm)."""

    partition: str = ""  # empty: the cluster's default partition
    account: str = ""
    time_min: int = 60  # the job's time limit; the run itself stops (TIMEOUT) 3 minutes before it
    gpus_per_node: int = 0  # with device=auto: CUDA when each rank of a node gets a GPU
    cpus_per_rank: int = 1
    mem_gb: float = 0  # per node; 0: the partition's default
    sbatch: list[str] = field(default_factory=list)  # extra sbatch lines, e.g. ["--qos=high", "--exclusive"]
    on_preempt: str = "requeue"  # requeue: run again from the start | interrupted: record INTERRUPTED
    folder: str = "runs/slurm"  # submitit's job folders (logs, pickles) and the jobs of each config


@dataclass
class LaunchConfig:
    launcher: str = "local"  # local: torchrun jobs from this process | slurm: Slurm jobs (tpbench.run.slurm)
    max_parallel: int = 4  # launcher=slurm: jobs of one sweep running at once
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    device: str = "auto"  # auto | cpu | cuda
    backend: str = "auto"  # auto | gloo | nccl
    nnodes: str = "1"  # torchrun --nnodes: a node count; no elastic "MIN:MAX", the world is tp x dp
    node_rank: int = 0
    nproc_per_node: int | None = None  # None: dp * tp / nnodes
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""  # host:port; empty: a free local port
    rdzv_id: str = "tpbench"
    collective_timeout_s: float = 300.0  # init_process_group(timeout=...): a hung collective fails
    job_timeout_s: float = 3600.0  # a worker running longer is stopped and the run recorded TIMEOUT
    memory_cap_mb: int = 0  # per worker, 0: none; CPU: RLIMIT_AS, CUDA: a memory fraction of the GPU
    max_result_mb: float = 64.0  # a rank result file larger than this is refused, the run FAILED
    # Consecutive runs of a sweep that fit one torchrun job run in it, its workers warm from one run to
    # the next (tpbench.run.batch says which fit); false: a fresh torchrun job for every run
    reuse_workers: bool = True
    # kind=validate on warm workers: up to this many consecutive runs that differ only in the parallel
    # model (mode, parallel.*, debug.*) are validated beside one dense model and its reference,
    # stepped once for them all (tpbench.experiments.validate.run_beside): the same figures, to the
    # bit, for a fraction of the CPU; each model's weights, gradients and AdamW moments stay in host
    # memory meanwhile (the Llama shape, 9 beside one: up to 11 GB a rank). 1: each run alone
    share_dense: int = 4
    # One process stands in for one rank of the tp x dp job, on torch's fake process group (see
    # tpbench.parallel.emulation): none | real (real tensors on this machine's device) | fake (FakeTensorMode)
    emulate: str = "none"
    emulate_rank: int | None = None  # the rank to emulate; None: the busiest rank of the mode
    emulate_gpu: str = "H100"  # device=cuda emulate=fake: whose allocator and cuBLAS workspaces
    # kind=validate in bf16: how a bf16 GEMM computes. native: torch's kernels | fp32_accumulate: the
    # fp32 GEMM of the bf16 values rounded once to bf16, as a GPU's bf16 GEMM computes; on a CPU
    # without AVX-512 BF16 its GEMMs run 40-90x faster than native (tpbench.models.gemm)
    bf16_gemm: str = "native"


@dataclass
class DbConfig:
    url: str = "sqlite:///runs/tpbench.db"
    # Where a run that did not end OK keeps its job folder (config, logs, error files), as RUN_ID/:
    # "" is logs/ beside the SQLite file (runs/logs/); give a folder for a database on a server
    logs: str = ""


@dataclass
class DebugConfig:
    # Gradient sums to switch off, to prove each one is needed:
    # qk_norm, kv_replicas, sp_norms, dp
    skip_grad_sum: list[str] = field(default_factory=list)
    # Break parallel.overlap, to prove validation catches it: no_wait (an entry gradient is returned
    # without its collective's result) | early_bucket (a DP bucket is sent at its first gradient)
    overlap_fault: str = ""
    # Break DDP's comm hook (parallel.engine=ddp), to prove validation catches it: no_divide (a bucket
    # is summed, not averaged) | drop_bucket (bucket 0 keeps this rank's own gradients)
    ddp_fault: str = ""
    # Plant an error where rank 0 cannot see it, to prove every validation figure is the worst over all
    # ranks: rank1_param (rank 1 adds 1 to one of its parameters after the AdamW steps; kind=validate)
    # rope_offset (TP rank 1, or DP rank 1 without TP, computes RoPE one position off) | no_backward_sum
    # (the first region entered under TP or SP without its backward all-reduce / reduce-scatter) |
    # raise_in_forward (rank 1 raises as its model's forward starts: a run that ends its job)
    validate_fault: str = ""
    # kind=validate: the gradient of one parameter (tpbench.experiments.planted.SCALED) multiplied by
    # this after the gradient sums, at every step: a relative gradient error of |grad_scale - 1|
    grad_scale: float = 1.0
    # Leave one dim's offset out of every dropout's mask (each rank draws part 0's mask there), to prove
    # validation catches it: no_seq_offset (SP) | no_head_offset (attention) | no_batch_offset (DP)
    dropout_fault: str = ""
    # Break a sharded DP level (parallel.dp_shard), to prove validation catches it: no_reduce_scatter
    # (each rank keeps its own gradients, never averaged) | no_all_gather (ZeRO-1: the other ranks'
    # stepped shards never arrive; FSDP2: the other ranks' shards of a block's weights are zeros) |
    # early_reduce_scatter (ZeRO-1 only: each bucket reduce-scattered at its first gradient, not its last)
    shard_fault: str = ""
    # Break train.grad_clip, to prove validation and the runs catch it (tpbench.parallel.clip):
    # double_count (every TP rank counts the replicated parameters in the global norm, not one) |
    # nonfinite (every rank writes inf into one gradient before the norm: kind memory or throughput)
    clip_fault: str = ""
    # kind=validate: the step (1-based) from which every planted bug above acts; 1: from the first
    # (a bug that starts late must fail at the step it starts: issue 56)
    from_step: int = 1
    # The DP gradient reduction in the compute dtype (bf16) where precision=mixed promises fp32, to prove
    # validation catches a precision-class bug
    low_precision_reduce: bool = False
    # kind=validate: one vocabulary row's gradient (of the embedding and the LM head, row
    # tpbench.experiments.planted.ROW) multiplied by this after the gradient sums (1: none)
    row_grad_scale: float = 1.0
    # kind=validate: one attention head's gradient (q_proj rows of head tpbench.experiments.planted.HEAD
    # in layer 0) multiplied by this after the gradient sums (1: none)
    head_grad_scale: float = 1.0
    # Break the sharded side's AdamW, to prove validation catches it (tpbench.experiments.optim):
    # decay_norm (model.norm.weight decays despite train.no_decay) | lr_ahead (its lr schedule a step ahead)
    optim_fault: str = ""


@dataclass
class RunConfig:
    kind: str = "validate"  # validate | memory | throughput
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    db: DbConfig = field(default_factory=DbConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    fault: str = ""  # fault injection, e.g. raise_on_rank1 (see tpbench.run.faults and conf/fault/)
    sweep: str = ""  # the sweep this run belongs to, if any


def register_schema() -> None:
    """Put RunConfig in Hydra's ConfigStore; conf/config.yaml starts its defaults list with it. Once a
    process: storing it builds the structured config anew (0.05 s, a fifth of composing one run)."""
    from hydra.core.config_store import ConfigStore  # here: a worker composes nothing, loads no hydra

    store = ConfigStore.instance()
    held = store.repo.get("run_schema.yaml")
    if held is None or OmegaConf.get_type(held.node) is not RunConfig:
        store.store(name="run_schema", node=RunConfig)


def save_run_config(cfg: RunConfig, path: Path) -> None:
    """Write a resolved config as the YAML file a worker reads with `load_run_config`. A string holding
    `${` is escaped, so that it is read back verbatim rather than interpolated."""
    OmegaConf.save(OmegaConf.create(_escaped(public_config(cfg))), path)


def hide_password(url: str) -> str:
    """The URL as it may be shown and stored: a password becomes ***."""
    from sqlalchemy.engine import make_url  # here: a worker never loads sqlalchemy
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # not a URL at all: nothing in it to hide that we could find
        return url


def _as_data(cfg: object) -> dict:
    """A config (a dataclass of plain values, as compose made it) as nested dicts: OmegaConf's
    to_container of it, 0.2 ms instead of 30 (tests/test_db.py checks the two equal on the presets)."""
    return dataclasses.asdict(cfg)


def public_config(cfg: RunConfig) -> dict:
    """The resolved config as stored and written to job folders: the database password hidden."""
    data = _as_data(cfg)
    data["db"]["url"] = hide_password(cfg.db.url)
    return data


def _escaped(node: object) -> object:
    if isinstance(node, dict):
        return {key: _escaped(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_escaped(value) for value in node]
    return node.replace("${", "\\${") if isinstance(node, str) else node


def load_run_config(path: str) -> RunConfig:
    """Read a resolved config file written by the launcher into a typed RunConfig."""
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def mode_label(p: ParallelConfig) -> str:
    """ddp, tp, tp_sp, tp_sp_linear, tp_vp, tp_sp_vp, tp_sp_linear_vp, or one with a dtensor_ prefix."""
    if p.engine == "ddp":
        return "ddp"
    sp = "_sp" + ("_linear" if p.sp_gather == "linear" else "") if p.sp else ""
    label = "tp" + sp + ("_vp" if p.vp else "")
    return f"dtensor_{label}" if p.engine == "dtensor" else label


def parallel_label(p: ParallelConfig) -> str:
    return layout_label(p.tp, p.dp, p.dp_shard, p.dp_replicate)


def run_label(c: RunConfig) -> str:
    """One run in a few words, as every line of the CLI names it: memory tp tp=2 dp=2 ZeRO-2 layers=2."""
    p = c.parallel
    return f"{c.kind} {mode_label(p)} {parallel_label(p)} layers={c.model.num_hidden_layers}"


def lean_rmsnorm(value: Any, recompute: str) -> bool:
    """model.lean_rmsnorm as a run builds it: auto is on where recompute is asked for (its memory
    saving wanted, and false refused there), off with recompute none; only True itself is on
    otherwise, so an unresolved "auto" is never read as true by its truthiness."""
    return recompute != "none" if value == "auto" else value is True


def local_batch(cfg: RunConfig) -> int:
    """Sequences per DP rank (shared by the TP ranks of its group) under the batch policy."""
    t = cfg.train
    return t.micro_batch if t.batch == "fixed_per_rank" else t.global_batch // cfg.parallel.dp


def world_size(cfg: RunConfig) -> int:
    return cfg.parallel.tp * cfg.parallel.dp


def local_world_size(cfg: RunConfig) -> int:
    """Processes on this node: one per rank, or the one that emulates a rank."""
    if cfg.launch.emulate != "none":
        return 1
    return cfg.launch.nproc_per_node or world_size(cfg) // int(cfg.launch.nnodes)


# How a run was launched and where it is stored, not what it measures: left out of the config hash.
_UNHASHED_LAUNCH = (
    "launcher", "max_parallel", "slurm", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
    "collective_timeout_s", "job_timeout_s", "max_result_mb", "reuse_workers", "share_dense",
)  # fmt: skip


# The keys the hash was made of when it last changed (the config of schema 6, commit a18794b): always
# hashed. A key added since is hashed only where it is not at its default, so that a new field leaves
# every recorded run's identity as it was (a sweep skips what a database has: tests/test_db.py). A
# field that should change every identity is a reason to bump this list, and says so.
_HASHED_KEYS = frozenset(
    f"{section}.{key}" if key else section
    for section, keys in {
        "debug": ("ddp_fault", "dropout_fault", "overlap_fault", "skip_grad_sum", "validate_fault"),
        "fault": ("",),
        "kind": ("",),
        "launch": (
            "backend", "device", "emulate", "emulate_gpu", "emulate_rank", "memory_cap_mb", "nnodes",
            "nproc_per_node",
        ),
        "model": (
            "attention_bias", "dropout", "flash_attn", "fused_swiglu", "head_dim", "hidden_size",
            "intermediate_size", "lean_rmsnorm", "max_position_embeddings", "name", "num_attention_heads",
            "num_hidden_layers", "num_key_value_heads", "qk_norm", "rms_norm_eps", "rope_high_freq_factor",
            "rope_low_freq_factor", "rope_original_max_position_embeddings", "rope_scaling_factor",
            "rope_theta", "tie_word_embeddings", "vocab_size",
        ),
        "parallel": (
            "ddp_bucket_mb", "ddp_gradient_as_bucket_view", "dp", "engine", "overlap", "sp", "sp_gather",
            "sp_regather", "tp", "vocab_pad_multiple", "vp",
        ),
        "train": (
            "batch", "compile", "dtype", "fused_optimizer", "global_batch", "keep_output", "loss", "lr",
            "micro_batch", "precision", "recompute", "seed", "seq_len", "steps", "warmup", "weight_decay",
        ),
        "validate": (
            "batch", "every", "lr", "steps", "tol_drift", "tol_fwd", "tol_grad_rel", "tol_loss", "tol_param",
        ),
    }.items()
    for key in keys
)  # fmt: skip


def config_hash(cfg: RunConfig) -> str:
    """Identity of an experiment: runs with the same hash measure the same thing. A key added to the
    config since `_HASHED_KEYS` counts only where it is not at its default."""
    data = _as_data(cfg)
    del data["db"], data["sweep"], data["model"]["hf_config"]
    data["model"]["lean_rmsnorm"] = lean_rmsnorm(cfg.model.lean_rmsnorm, cfg.train.recompute)  # what runs
    for key in _UNHASHED_LAUNCH:
        del data["launch"][key]
    _drop_new_defaults(data, cfg, "")
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _drop_new_defaults(data: dict, obj: object, prefix: str) -> None:
    """Remove from `data` (dataclass `obj` as a container) each key unknown to `_HASHED_KEYS` whose
    value is its field's default; a known section is walked into."""
    for f in dataclasses.fields(obj):
        if f.name not in data:
            continue
        path, value = prefix + f.name, getattr(obj, f.name)
        if path in _HASHED_KEYS:
            continue
        if dataclasses.is_dataclass(value) and any(k.startswith(path + ".") for k in _HASHED_KEYS):
            _drop_new_defaults(data[f.name], value, path + ".")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            default = _as_data(default)
        if data[f.name] == default:
            del data[f.name]
