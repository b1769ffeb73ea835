"""What `tpbench plan` and `tpbench fit` assume where the overrides leave a choice open: one set, the
run's own (what `tpbench run` with the same overrides would step), so that one layout gets the same
peak and step from both (tests/test_fit.py); each output says what it assumed (`assumed`).

  optimizer    train.fused_optimizer=auto: AdamW's fused kernel on CUDA, as torchtitan trains and as
               `tpbench run` steps there (less memory at the optimizer step, and a faster one); on a
               CPU torch's default, unfused; false: unfused (for-each on CUDA), as the seed's presets
  precision    the model preset's: bf16 mixed (fp32 master weights and AdamW moments) for every published
               model of conf/model/; the config's fp32 pure for the others; precision= and dtype= set it
  recompute    none (train.recompute=); fit searches none, selective, op and full unless it is given
  micro-batch  the model preset's, else 2 (train.micro_batch=); fit searches it unless it is given
  sequence     the model preset's (seq= sets it); fit refuses a model whose preset has none
  decay, lr    train.no_decay and train.lr_scheduler, said where set (`optimizer_label`): they change no
               byte and no step time (docs/results/optimizer_groups.md), only what a run trains
  GPU          gpu=NAME: predict for that GPU (launch.device=cuda, the GPU's rates and its allocator's
               workspaces), in `plan` as in `fit`; `plan` without it predicts for the device it runs on
"""

from __future__ import annotations

from tpbench.config import CONF_DIR, SHORT_NAMES, ConfigError, RunConfig, TrainConfig

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def precision_words(precision: str, dtype: str) -> str:
    """bf16 compute, fp32 master weights and AdamW moments; fp32 weights, gradients and AdamW moments."""
    short = SHORT.get(dtype, dtype)
    if precision == "mixed":
        return f"{short} compute, fp32 master weights and AdamW moments"
    return f"{short} weights, gradients and AdamW moments"


def clip_words(cfg: RunConfig) -> str:
    """The words ", gradient clipping at 1 (train.grad_clip=1.0)" where a run clips its gradients' norm
    (tpbench.parallel.clip: a norm and a scaling a step, two scalar all-reduces); "" where not."""
    clip = cfg.train.grad_clip
    return f", gradient clipping at {clip:g} (train.grad_clip={clip})" if clip > 0 else ""


def optimizer_words(cfg: RunConfig) -> str:
    return "fused AdamW" if cfg.train.fused_optimizer else "for-each AdamW"


def optimizer_label(t: TrainConfig) -> str:
    """AdamW's weight-decay groups and lr schedule in a few words (tpbench.experiments.optim), as `fit`
    and the report name them, e.g. "no decay on norms+biases · warm-up 200, cosine decay to 0.1";
    "" for the defaults (every parameter at train.weight_decay, a constant lr)."""
    parts = [f"no decay on {'+'.join(t.no_decay)}"] if t.no_decay and t.weight_decay else []
    s = t.lr_scheduler
    if not s.constant():
        over = "" if s.decay_ratio is None else f" over {s.decay_ratio:g} of the steps"
        floor = f" to {s.min_lr_factor:g}" if s.min_lr_factor else ""
        parts.append(f"warm-up {s.warmup_steps}, {s.decay_type} decay{over}{floor}")
    return " · ".join(parts)


def assumed(cfg: RunConfig, searched: bool = False) -> str:
    """The line every plan and fit output carries: the optimizer, the precision, and (`searched`: fit,
    whose rows say their own) the recompute and micro-batch it predicted for."""
    t = cfg.train
    said = (
        f"assumed: {optimizer_words(cfg)} (train.fused_optimizer={str(t.fused_optimizer).lower()}), "
        f"{t.precision} precision ({precision_words(t.precision, t.dtype)})"
    )
    if optimizer_label(t):  # the weight-decay groups and lr schedule, where not the defaults
        said += f", {optimizer_label(t)}"
    if searched:
        return said + clip_words(cfg)
    return f"{said}, recompute {t.recompute}, micro-batch {t.micro_batch}{clip_words(cfg)}"


def assumed_dict(cfg: RunConfig) -> dict:
    t = cfg.train
    return {
        "fused_optimizer": t.fused_optimizer,
        "precision": t.precision,
        "dtype": t.dtype,
        "recompute": t.recompute,
        "micro_batch": t.micro_batch,
    }


def for_gpu(overrides: list[str]) -> list[str]:
    """`plan`'s overrides with gpu=NAME read as fit reads it: a prediction for that GPU
    (launch.device=cuda, launch.emulate_gpu=NAME). Raises ConfigError for gpu= beside launch.device=cpu."""
    gpus = [o for o in overrides if o.startswith("gpu=")]
    if not gpus:
        return overrides
    devices = [o for o in overrides if o.partition("=")[0].lstrip("+~") in ("launch.device", "device")]
    if any(not o.endswith("=cuda") for o in devices):
        raise ConfigError(
            f"{gpus[0]} with {devices[0]}: gpu= predicts for that GPU; accepted are launch.device=cuda "
            "or no launch.device"
        )
    named = [f"launch.emulate_gpu={o[4:]}" if o in gpus else o for o in overrides]
    return named + ([] if devices else ["launch.device=cuda"])


def preset_seq(model: str) -> int | None:
    """The sequence length conf/model/MODEL.yaml trains at; None where it names none."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{model}.yaml"
    if not path.is_file():
        return None
    seq = OmegaConf.select(OmegaConf.load(path), "train.seq_len")
    return int(seq) if seq is not None else None


def check_seq(cfg: RunConfig, given: set[str]) -> None:
    """fit's sequence: seq= where given, else the model preset's; a model with none is refused."""
    if SHORT_NAMES["seq"] in given:
        return
    seq = None if cfg.model.hf_config else preset_seq(cfg.model.name)
    if seq is None:
        what = "a model.hf_config" if cfg.model.hf_config else f"model={cfg.model.name}"
        raise ConfigError(
            f"fit needs seq=LENGTH: {what} names no sequence length to train at "
            "(the published models' presets do)"
        )
