"""From command-line overrides to checked RunConfigs, before anything is launched or written.

Hydra's compose API reads conf/ into the RunConfig schema; Hydra's override parser reads the overrides
and its BasicSweeper expands `layers=8,16 mode=ddp,tp` (and a preset's `hydra.sweeper.params`) into
the cartesian product. Every value is then checked, so a bad one is one line naming it and what is
accepted (a `ConfigError`), and `auto` devices are resolved for the machine at hand. Where the
results go (db.url, launcher=slurm) is checked above, by tpbench.run.sweep: this module knows nothing of
the database or of Slurm.

Neither this module nor what it imports loads torch: a bad value is refused in a fraction of a second,
and torch loads in resolve_device, after every check (tests/test_fast_refusal.py).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import math
from collections.abc import Sequence
from functools import reduce

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, ValidationError

from tpbench import config_schema, machine
from tpbench.config import (
    CONF_DIR,
    SHORT_NAMES,
    ConfigError,
    RunConfig,
    local_world_size,
    register_schema,
    world_size,
)
from tpbench.experiments import KINDS
from tpbench.experiments.criterion import check_bf16_gemm, check_validate_faults
from tpbench.parallel.checks import (
    GRAD_SUMS,
    check_compile,
    check_dp_shard,
    check_dtensor_shardable,
    check_shardable,
    resolve_switches,
)
from tpbench.parallel.names import EMULATED_KINDS, FLAVOURS
from tpbench.predict import hardware
from tpbench.predict.checked import check_measurable
from tpbench.run.faults import FAULTS, check_fault

GROUPS = ("model", "mode", "batch", "kind", "device", "db", "launcher", "+preset", "+fault")

CHOICES = {
    "kind": KINDS,
    "parallel.engine": ("megatron", "ddp", "dtensor"),
    "parallel.sp_gather": ("region", "linear"),
    "train.batch": ("fixed_per_rank", "fixed_global"),
    "train.dtype": ("float32", "bfloat16", "float16"),
    "train.precision": ("pure", "mixed"),
    "parallel.dp_shard": ("none", "optimizer", "grads", "full"),
    "train.loss": ("cross_entropy", "logits_mean"),
    "train.recompute": ("none", "selective", "full", "op"),
    "launch.device": ("auto", "cpu", "cuda"),
    "launch.backend": ("auto", "gloo", "nccl"),
    "launch.rdzv_backend": ("c10d", "static"),
    "launch.launcher": ("local", "slurm"),
    "launch.slurm.on_preempt": ("requeue", "interrupted"),
    "fault": ("", *FAULTS),
    "launch.emulate": FLAVOURS,
    "launch.emulate_gpu": hardware.allocator_names(),
    "launch.bf16_gemm": ("native", "fp32_accumulate"),
    "debug.overlap_fault": ("", "no_wait", "early_bucket"),
    "debug.ddp_fault": ("", "no_divide", "drop_bucket"),
    "debug.validate_fault": ("", "rank1_param", "rope_offset", "no_backward_sum", "raise_in_forward"),
    "validate.batch": ("fresh", "fixed"),
}
AT_LEAST_ONE = (
    "model.hidden_size",
    "model.num_hidden_layers",
    "model.num_attention_heads",
    "model.num_key_value_heads",
    "model.vocab_size",
    "parallel.tp",
    "parallel.dp",
    "launch.share_dense",
    "parallel.dp_replicate",
    "train.seq_len",
    "train.micro_batch",
    "train.accumulation",
    "train.global_batch",
    "train.steps",
    "validate.steps",
    "validate.every",
    "launch.max_parallel",
    "launch.slurm.cpus_per_rank",
    "model.rope_original_max_position_embeddings",
)
AT_LEAST_ZERO = (
    "parallel.zero_bucket_elements",
    "train.warmup",
    "train.seed",
    "launch.node_rank",
    "launch.memory_cap_mb",
    "launch.slurm.gpus_per_node",
    "launch.slurm.mem_gb",
)
POSITIVE = (
    "launch.collective_timeout_s",
    "launch.job_timeout_s",
    "launch.max_result_mb",
    "model.rope_theta",
    "model.rms_norm_eps",
    "model.rope_scaling_factor",
    "model.rope_low_freq_factor",
    "model.rope_high_freq_factor",
    "parallel.ddp_bucket_mb",
    "validate.lr",
)
AT_LEAST_ZERO_FLOAT = (
    "train.lr",
    "train.weight_decay",
    "validate.k",
    "validate.tol_fwd",
    "validate.tol_loss",
    "validate.tol_grad_rel",
    "validate.tol_param",
    "validate.tol_drift",
)
MODES = tuple(sorted(p.stem for p in (CONF_DIR / "mode").glob("*.yaml")))
MAX_SECONDS = 10**7  # timeouts: about 4 months; past 2**32 s the worker's alarm() and timedelta overflow


def expand(overrides: Sequence[str], single: bool = False, launching: bool = True) -> list[RunConfig]:
    """Every run the overrides ask for, in sweep order, checked and with devices resolved.

    `kind=all` (the default) becomes one run per kind. `single`: refuse a sweep. `launching`: the runs
    are to be measured (not only predicted, as `plan` and `fit` do). Raises ConfigError.
    """
    register_schema()
    parser = OverridesParser.create()
    user = _parse(parser, overrides)
    typed = {o.key_or_group: o.input_line for o in user}
    _check_added_keys(user)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        fixed = [_as_string(o) for o in user if not o.is_sweep_override()]
        params = {}
        if any(o.key_or_group.split(".")[0] in ("preset", "hydra") for o in user):
            # a preset's sweep is in its hydra.sweeper.params: composed once more, with Hydra's own
            # config (0.3 s, only when there is one to read)
            params = _compose(fixed, typed, hydra=True).hydra.sweeper.params or {}
        preset = _parse(parser, [f"{key}={value}" for key, value in params.items()])
        _check_booleans(preset + user)
        (combos,) = BasicSweeper.split_arguments(preset + user, None)
        if single and len(combos) > 1:
            _compose(fixed, typed)  # a bad fixed value is named before the sweep is refused
            raise ConfigError(
                f"{' '.join(overrides)}: a sweep of {len(combos)} configs, `tpbench run` runs one: "
                f"use `tpbench sweep` with the same overrides"
            )
        for combo in combos:
            _check_mode(combo)
        runs = [run for combo in combos for run in _runs_of(_compose(combo, typed))]
    given = {o.key_or_group for o in preset + user}
    for run in runs:
        apply_hf_config(run, given)
        check(run)
        if launching:
            check_measurable(run)
        resolve_device(run, launching)
    return runs


def apply_hf_config(cfg: RunConfig, given: set[str]) -> None:
    """model.hf_config=PATH: the model's fields from that Hugging Face config (tpbench.models.hf_config), but
    for those the overrides give themselves (model.num_hidden_layers=4 shrinks the model it read)."""
    if not cfg.model.hf_config:
        return
    from tpbench.models.hf_config import model_fields  # transformers loads only when a config asks for it

    for key, value in model_fields(cfg.model.hf_config).items():
        if f"model.{key}" not in given:
            setattr(cfg.model, key, value)


def check(cfg: RunConfig) -> None:
    """Raise ConfigError, one line, for the first value a run cannot be launched with."""
    for key, accepted in CHOICES.items():
        if _get(cfg, key) not in accepted:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: accepted are {', '.join(map(repr, accepted))}")
    for key, least, what in [(k, 1, "integers >= 1") for k in AT_LEAST_ONE] + [
        (k, 0, "integers >= 0") for k in AT_LEAST_ZERO
    ]:
        if _get(cfg, key) < least:
            raise ConfigError(f"{key}={_get(cfg, key)}: accepted are {what}")
    for key in (*POSITIVE, *AT_LEAST_ZERO_FLOAT):
        value = _get(cfg, key)
        least, what = (0, "> 0") if key in POSITIVE else (0, ">= 0")
        if not math.isfinite(value) or value < least or (key in POSITIVE and value == least):
            raise ConfigError(f"{key}={value}: accepted are finite numbers {what}")
    for key in ("launch.collective_timeout_s", "launch.job_timeout_s"):
        if _get(cfg, key) > MAX_SECONDS:
            raise ConfigError(f"{key}={_get(cfg, key)}: accepted are seconds up to {MAX_SECONDS:g}")
    for key in (
        "model.intermediate_size",
        "model.head_dim",
        "launch.nproc_per_node",
        "parallel.vocab_pad_multiple",
    ):
        if _get(cfg, key) is not None and _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)}: accepted are integers >= 1")
    check_dp_shard(cfg)
    _check_precision(cfg)
    for key, what in (("fused_swiglu", "SwiGLU"), ("lean_rmsnorm", "RMSNorm")):
        if not getattr(cfg.model, key) and cfg.train.recompute != "none":
            raise ConfigError(
                f"model.{key}=false with train.recompute={cfg.train.recompute}: MiniMind's own {what} "
                "is there to measure its own step, without recompute; accepted is train.recompute=none"
            )
    if cfg.parallel.overlap and cfg.parallel.engine != "megatron":
        raise ConfigError(
            f"parallel.overlap=true with parallel.engine={cfg.parallel.engine}: accepted with engine "
            "megatron only (DDP always overlaps its gradient buckets; DTensor's TP has no async switch here)"
        )
    check_compile(cfg)
    if cfg.debug.overlap_fault and not cfg.parallel.overlap:
        raise ConfigError(
            f"debug.overlap_fault={cfg.debug.overlap_fault}: breaks parallel.overlap, "
            "accepted with parallel.overlap=true"
        )
    if cfg.debug.ddp_fault and cfg.parallel.engine != "ddp":
        raise ConfigError(
            f"debug.ddp_fault={cfg.debug.ddp_fault}: breaks DDP's comm hook, "
            "accepted with parallel.engine=ddp"
        )
    check_validate_faults(cfg)
    for name in cfg.debug.skip_grad_sum:
        if name not in GRAD_SUMS:
            accepted = ", ".join(GRAD_SUMS)
            raise ConfigError(f"debug.skip_grad_sum has {name!r}: accepted are {accepted}")
    _check_keep_output(cfg)
    _check_emulation(cfg)
    check_bf16_gemm(cfg)
    _check_nodes(cfg)
    check_fault(cfg)
    check_shardable(cfg)
    check_dtensor_shardable(cfg.model, cfg.parallel)
    if importlib.util.find_spec(f"tpbench.experiments.{cfg.kind}") is None:
        available = [k for k in KINDS if importlib.util.find_spec(f"tpbench.experiments.{k}")]
        raise ConfigError(
            f"kind={cfg.kind}: not implemented in this tpbench yet (no tpbench/experiments/{cfg.kind}.py); "
            f"available are {', '.join(available) or 'none'}"
        )


def resolve_device(cfg: RunConfig, launching: bool = True) -> None:
    """Replace device/backend `auto` by what this node has: CUDA + NCCL with a GPU per local rank.
    `launching`: the runs are to run here (else predicted only, as `plan` and `fit` do: launch.device=cuda
    names the GPUs planned for, which this machine need not have)."""
    launch = cfg.launch
    local_ranks = local_world_size(cfg)
    # On Slurm the ranks run on the job's nodes, not here: they get what the job asks for.
    gpus = launch.slurm.gpus_per_node if launch.launcher == "slurm" else machine.gpus_here()
    if launch.device == "auto":
        launch.device = "cuda" if gpus >= local_ranks else "cpu"
    if launch.device == "cuda" and gpus < local_ranks and launch.emulate != "fake" and launching:
        raise ConfigError(
            f"launch.device=cuda: {local_ranks} ranks on a node need {local_ranks} GPUs, "
            + (f"launch.slurm.gpus_per_node={gpus}" if launch.launcher == "slurm" else f"torch sees {gpus}")
            + "; accepted here are auto, cpu"
        )
    if launch.device == "cuda" and launch.bf16_gemm != "native":
        raise ConfigError(
            f"launch.bf16_gemm={launch.bf16_gemm} with launch.device=cuda: a GPU's bf16 GEMM accumulates "
            "in fp32 already; accepted is launch.bf16_gemm=native there (or launch.device=cpu)"
        )
    if launch.backend == "auto":
        launch.backend = "nccl" if launch.device == "cuda" else "gloo"
    if launch.backend == "nccl" and launch.device != "cuda":
        raise ConfigError(f"launch.backend=nccl with launch.device={launch.device}: nccl needs cuda")
    resolve_switches(cfg)


def _parse(parser: OverridesParser, overrides: Sequence[str]) -> list[Override]:
    try:
        parsed = parser.parse_overrides(list(overrides))
    except OverrideParseException as e:
        raise ConfigError(f"{e.override}: not an override KEY=VALUE ({e.message.splitlines()[1]})") from None
    for o in parsed:
        if o.is_delete() or o.key_or_group.split(".")[0] == "hydra":
            what = (
                "removes a setting, which every run needs (set it: KEY=VALUE)"
                if o.is_delete()
                else "Hydra's own setting, which tpbench never reads (results go to db.url)"
            )
            raise ConfigError(
                f"{o.input_line}: {what}; accepted are KEY=VALUE with the keys of `tpbench run --cfg`"
            )
        group = o.key_or_group
        if f"+{group}" in GROUPS and not o.is_add():  # Hydra: "Could not override 'fault'. No match ..."
            names = sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))
            raise ConfigError(
                f"{o.input_line}: {group} is a group added with +; accepted are "
                + ", ".join(f"+{group}={name}" for name in names)
            )
    return [
        dataclasses.replace(o, key_or_group=SHORT_NAMES.get(o.key_or_group, o.key_or_group)) for o in parsed
    ]


def _check_added_keys(overrides: list[Override]) -> None:
    """`+key=value` appends a config group (+preset, +fault); a key the schema lacks is refused, not
    added to a config that nothing reads."""
    groups = {g.lstrip("+") for g in GROUPS}
    for o in overrides:
        if o.is_add() and o.key_or_group not in groups:
            raise ConfigError(
                f"{o.input_line}: {o.key_or_group} is not a tpbench setting and cannot be added; accepted "
                f"with + are the groups +preset and +fault, and keys as key=value without +"
            )


def _check_booleans(overrides: list[Override]) -> None:
    """A bool setting takes true or false only (OmegaConf would also take 2, yes, on, 1)."""
    for o in overrides:
        if config_schema.field_type(o.key_or_group, default="") != "bool":
            continue
        values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        for value in values:
            if not isinstance(value, bool):
                raise ConfigError(f"{o.input_line}: {o.key_or_group} takes bool: accepted are true, false")


def _check_mode(combo: list[str]) -> None:
    """mode=NAME with a switch that NAME sets otherwise (mode=tp_sp_vp sp=false) is a contradiction, not
    a quiet change of mode: refused. The mode's sizes (tp, dp) may change."""
    given = dict(o.split("=", 1) for o in combo)
    if "mode" not in given:
        return
    mode = OmegaConf.load(CONF_DIR / "mode" / f"{given['mode']}.yaml") if given["mode"] in MODES else {}
    for key in ("sp", "vp", "engine", "sp_gather"):
        said = given.get(f"parallel.{key}")
        if said is not None and key in mode and said.lower() != str(mode[key]).lower():
            raise ConfigError(
                f"mode={given['mode']} with parallel.{key}={said.lower()}: mode={given['mode']} sets "
                f"parallel.{key}={str(mode[key]).lower()}; accepted is one of the two (another mode: "
                f"{', '.join(MODES)})"
            )


def _as_string(o: Override) -> str:
    """The override as Hydra's BasicSweeper writes it for one job."""
    return f"{o.get_key_element()}={o.get_value_element_as_str()}"


CONFIG_GROUPS = frozenset(str(d.relative_to(CONF_DIR)) for d in CONF_DIR.rglob("*") if d.is_dir())  # a/b
_COMPOSED: dict[tuple[str, ...], DictConfig] = {}  # group overrides -> their composition, hydra node kept


def _compose(overrides: list[str], typed: dict[str, str], hydra: bool = False) -> DictConfig:
    """Hydra's compose of conf/config.yaml, in its own two parts: what the group overrides select
    (model=, +preset=, ...) composed once a process (0.1-0.2 s), then the value overrides applied to a
    copy by Hydra's `_apply_overrides_to_config` (tests/test_compose_cache.py: as a whole compose).
    hydra.* (its search path decides which groups exist) composes whole."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    if hydra or any(o.key_or_group.split(".")[0].split("/")[0] == "hydra" for o in parsed):
        return _compose_whole(overrides, typed, hydra)
    groups = tuple(o.input_line for o in parsed if o.key_or_group.split("@")[0] in CONFIG_GROUPS)
    if (base := _COMPOSED.get(groups)) is None:
        base = _COMPOSED[groups] = _compose_whole(list(groups), typed, hydra=True)
    cfg = copy.deepcopy(base)
    values = [o for o in parsed if o.key_or_group.split("@")[0] not in CONFIG_GROUPS]
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except ConfigCompositionException as e:
        raise ConfigError(_explain(e, typed)) from None
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _compose_whole(overrides: list[str], typed: dict[str, str], hydra: bool) -> DictConfig:
    try:
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)
    except MissingConfigException as e:
        if not e.options or not e.missing_cfg_file:
            raise ConfigError(" ".join(str(e).split())) from None
        group, name = e.missing_cfg_file.rsplit("/", 1)
        raise ConfigError(f"{group}={name}: accepted are {', '.join(sorted(e.options))}") from None
    except ConfigCompositionException as e:
        raise ConfigError(_explain(e, typed)) from None


def _explain(e: ConfigCompositionException, typed: dict[str, str]) -> str:
    cause = e.__cause__
    if isinstance(cause, ConfigAttributeError | ConfigKeyError):
        key = cause.full_key
        near = difflib.get_close_matches(key, [*SHORT_NAMES, *config_schema.schema_keys()], n=1)
        guess = f" (did you mean {near[0]}?)" if near else ""
        return (
            f"{typed.get(key, key)}: {key} is not a tpbench setting{guess}; "
            f"accepted are the short names {', '.join(SHORT_NAMES)}, the groups {', '.join(GROUPS)} and the "
            "keys of `tpbench run --cfg`"
        )
    if isinstance(cause, ValidationError):
        key = cause.full_key
        takes = config_schema.field_type(key)
        return f"{typed.get(key, key)}: {key} takes {takes} ({str(cause).splitlines()[0]})"
    return " ".join(str(e).split())


def _runs_of(composed: DictConfig) -> list[RunConfig]:
    try:
        run: RunConfig = OmegaConf.to_object(composed)  # type: ignore[assignment]
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is missing: give it, e.g. {e.full_key}=VALUE") from None
    if run.kind != "all":
        return [run]
    kinds = EMULATED_KINDS if run.launch.emulate != "none" else KINDS
    return [dataclasses.replace(copy.deepcopy(run), kind=kind) for kind in kinds]


def _check_precision(cfg: RunConfig) -> None:
    t = cfg.train
    if t.dtype == "float16" and t.precision == "pure":
        raise ConfigError(
            "train.dtype=float16 with train.precision=pure: AdamW's eps (1e-8) underflows to 0 in fp16, "
            "so a parameter row without gradient turns NaN after one step; accepted are "
            "precision=mixed (fp32 master weights and optimizer state) or dtype=bfloat16"
        )
    if t.precision == "mixed" and t.dtype == "float32":
        raise ConfigError(
            "train.precision=mixed with train.dtype=float32: mixed runs forward under autocast to a "
            "16-bit dtype; accepted are dtype=bfloat16 or float16, or precision=pure"
        )


def _check_nodes(cfg: RunConfig) -> None:
    launch, world = cfg.launch, world_size(cfg)
    if not launch.nnodes.isdigit() or int(launch.nnodes) < 1:
        raise ConfigError(
            f"launch.nnodes={launch.nnodes!r}: accepted are node counts such as 1 or 2 (the world is "
            f"fixed at tp x dp = {world} ranks)"
        )
    nnodes = int(launch.nnodes)
    per_node = launch.nproc_per_node
    if (per_node is None and world % nnodes) or (per_node is not None and per_node * nnodes != world):
        raise ConfigError(
            f"launch.nnodes={nnodes}, launch.nproc_per_node={per_node}: the {world} ranks (tp x dp) must "
            f"fill the nodes evenly"
        )
    if launch.node_rank >= nnodes:
        raise ConfigError(f"launch.node_rank={launch.node_rank}: accepted are 0 to {nnodes - 1}")
    if nnodes > 1 and not launch.rdzv_endpoint and launch.launcher != "slurm":  # Slurm: the first node
        raise ConfigError(
            f"launch.nnodes={nnodes} needs launch.rdzv_endpoint=HOST:PORT (reached by all nodes)"
        )


def _check_keep_output(cfg: RunConfig) -> None:
    t, p = cfg.train, cfg.parallel
    if t.keep_output and p.vp and p.tp > 1 and t.loss == "cross_entropy":
        raise ConfigError(
            "train.keep_output=true with parallel.vp=true and train.loss=cross_entropy: the vocab-parallel "
            "loss turns the logits into their gradient in place, so there is no output to keep; accepted "
            "are train.loss=logits_mean, parallel.vp=false or train.keep_output=false"
        )


def _check_emulation(cfg: RunConfig) -> None:
    launch, world = cfg.launch, world_size(cfg)
    if launch.emulate == "none":
        if launch.emulate_rank is not None:
            raise ConfigError(
                f"launch.emulate_rank={launch.emulate_rank} without launch.emulate: accepted are "
                f"launch.emulate=real or fake with it"
            )
        return
    if cfg.kind not in EMULATED_KINDS:
        raise ConfigError(
            f"kind={cfg.kind} with launch.emulate={launch.emulate}: an emulated rank has no real "
            f"collectives to check or time; accepted is kind={', '.join(EMULATED_KINDS)}"
        )
    if launch.emulate_rank is not None and not 0 <= launch.emulate_rank < world:
        raise ConfigError(
            f"launch.emulate_rank={launch.emulate_rank}: accepted are 0 to {world - 1} (tp x dp = {world})"
        )
    if launch.nnodes != "1" or cfg.fault:
        what = f"launch.nnodes={launch.nnodes}" if launch.nnodes != "1" else f"fault={cfg.fault}"
        raise ConfigError(f"{what} with launch.emulate={launch.emulate}: an emulated rank runs alone")


def _get(cfg: RunConfig, key: str):
    return reduce(getattr, key.split("."), cfg)
