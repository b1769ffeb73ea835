"""A model's shape from a Hugging Face config: `model.hf_config=PATH`, a config.json or a folder holding one.

It is read with transformers' own config classes (LlamaConfig, Qwen2Config, Qwen3Config; MiniMind's
config, whose class lives in MiniMind's repository, with transformers' PretrainedConfig and MiniMind's
defaults), from the local file only: no network, no weights. transformers is the optional `hf` extra.
The architectures are LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and MiniMindForCausalLM;
whatever the dense model cannot be (experts, sliding windows, cross-attention, another model_type, an
activation other than SiLU, biases it lacks, a RoPE other than the plain one or Llama-3.1's) is refused
in one line naming the field. What a family fixes in its code rather than its config comes from here:
Qwen2 always has q, k, v biases and no q/k norms, Qwen3 and MiniMind have q/k norms, Llama neither.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

from tpbench.config import ConfigError
from tpbench.models.minimind import MiniMindConfig

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "minimind": "MiniMindForCausalLM",
}
QK_NORM = {"llama": False, "qwen2": False, "qwen3": True, "minimind": True}
# fields that give a model experts: refused unless zero or unset (MiniMind's config carries its MoE
# fields in a dense model too: there `use_moe` says whether they are used)
EXPERTS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
)
MINIMIND_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MiniMindConfig)}


def config_file(path: str) -> Path:
    """The config.json that `path` names: the file itself, or the one in the folder."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(
            f"model.hf_config={path}: no such file"
            + (" (the folder holds no config.json)" if p.is_dir() else "")
            + "; accepted are a Hugging Face config.json or a folder holding one"
        )
    return file


@cache
def model_fields(path: str) -> dict[str, object]:
    """ModelConfig's fields (name, shape, norms, biases, RoPE) from the config at `path`; ConfigError
    (one line naming the field) for what the dense model cannot represent."""
    file = config_file(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.hf_config={path}: not a JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"model.hf_config={path}: not a JSON object of a model's config")
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"model.hf_config={path}: model_type={model_type!r}; accepted are {', '.join(ARCHITECTURES)} "
            f"({', '.join(ARCHITECTURES.values())})"
        )
    architectures = raw.get("architectures") or [ARCHITECTURES[model_type]]
    if architectures != [ARCHITECTURES[model_type]]:
        raise ConfigError(
            f"model.hf_config={path}: architectures={architectures}; accepted for model_type {model_type} "
            f"is [{ARCHITECTURES[model_type]!r}] (a causal LM, nothing else on top)"
        )
    _refuse_what_it_cannot_be(path, raw, model_type)
    if model_type != "minimind":  # refused before transformers reads it, which warns of a YaRN's fields
        params = raw.get("rope_parameters") or raw.get("rope_scaling")
        _refuse_rope_type(path, params if isinstance(params, dict) else {})
    config = _transformers_config(path, file, model_type)

    def get(key: str):
        if model_type == "minimind":  # PretrainedConfig knows none of MiniMind's defaults
            return getattr(config, key, MINIMIND_DEFAULTS.get(key))
        return getattr(config, key)

    refused = [
        ("hidden_act", get("hidden_act"), "silu"),
        ("mlp_bias", getattr(config, "mlp_bias", False), False),
        ("attention_dropout", getattr(config, "attention_dropout", 0.0), 0.0),
        ("dropout", getattr(config, "dropout", 0.0), 0.0),
        ("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0), 1.0),
    ]
    if model_type != "qwen2":  # Llama's and Qwen3's attention_bias puts one on o_proj too: ours never has
        refused.append(("attention_bias", bool(getattr(config, "attention_bias", False)), False))
    for key, value, accepted in refused:
        if value != accepted:
            raise ConfigError(f"model.hf_config={path}: {key}={value!r}; the dense model takes {accepted!r}")
    heads = get("num_attention_heads")
    fields = {
        "name": file.parent.name if file.name == "config.json" else file.stem,
        "hidden_size": get("hidden_size"),
        "num_hidden_layers": get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("num_key_value_heads") or heads,
        "vocab_size": get("vocab_size"),
        "intermediate_size": get("intermediate_size"),
        "rms_norm_eps": get("rms_norm_eps"),
        "max_position_embeddings": get("max_position_embeddings"),
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "qk_norm": QK_NORM[model_type],
        # as the config states it, else as transformers' class gives it (Qwen3Config's default is
        # 128); None: H / heads (LlamaConfig derives it so; Qwen2Config has no such field)
        "head_dim": get("head_dim") if "head_dim" in raw else _head_dim(config, get("hidden_size"), heads),
        "attention_bias": model_type == "qwen2",  # Qwen2: q, k and v with biases, o_proj without
        **_rope(path, config, model_type),
    }
    if model_type == "minimind":
        fields["flash_attn"] = bool(get("flash_attn"))
    _say_defaults(path, raw, fields, type(config).__name__)
    return fields


# ModelConfig's fields read from a key of config.json of the same name, but these
_RAW_KEYS = {"rope_theta": ("rope_theta", "rope_parameters", "rope_scaling")}
_SHAPE = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
    "intermediate_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "head_dim",
    "rope_theta",
)  # fmt: skip


def _head_dim(config, hidden: int, heads: int) -> int | None:
    default = getattr(config, "head_dim", None)
    return None if default is None or default == hidden // heads else int(default)


def defaulted(raw: dict, fields: dict[str, object]) -> dict[str, object]:
    """The shape's fields the config.json does not state: the values transformers' class (or MiniMind's
    defaults) gave them. A missing intermediate_size once gave Llama's 11,008 for hidden 256 unseen."""
    return {
        key: fields[key]
        for key in _SHAPE
        if not any(k in raw for k in _RAW_KEYS.get(key, (key,)))
        and not (key == "num_key_value_heads" and fields[key] == fields["num_attention_heads"])
        and not (key == "head_dim" and fields[key] is None)
    }


def _say_defaults(path: str, raw: dict, fields: dict[str, object], cls: str) -> None:
    """One line on stderr, once a process (model_fields is cached), naming the defaulted fields."""
    import sys

    given = defaulted(raw, fields)
    if given:
        said = ", ".join(f"{k}={v}" for k, v in given.items())
        print(f"model.hf_config={path}: not in the file, so {cls}'s defaults: {said}", file=sys.stderr)


def _refuse_what_it_cannot_be(path: str, raw: dict, model_type: str) -> None:
    """The raw config's fields that ask for what the dense model is not, named one at a time."""
    if model_type == "minimind":
        experts = [("use_moe", raw.get("use_moe"))] if raw.get("use_moe") else []
    else:
        experts = [(key, raw[key]) for key in EXPERTS if raw.get(key)]
    sliding = [("use_sliding_window", True)] if raw.get("use_sliding_window") else []
    kinds = sorted({k for k in raw.get("layer_types") or [] if k != "full_attention"})
    sliding += [("layer_types", kinds)] if kinds else []
    cross = [(key, raw[key]) for key in ("cross_attention_layers", "add_cross_attention") if raw.get(key)]
    cross += [("is_encoder_decoder", True)] if raw.get("is_encoder_decoder") else []
    scaling = [("inference_rope_scaling", True)] if raw.get("inference_rope_scaling") else []
    for what, found in (
        ("experts (MoE)", experts),
        ("a sliding window", sliding),
        ("cross-attention", cross),
        ("MiniMind's YaRN RoPE", scaling),
    ):
        if found:
            key, value = found[0]
            raise ConfigError(
                f"model.hf_config={path}: {key}={json.dumps(value)} asks for {what}, which the dense model "
                "does not have; accepted are dense decoders with full causal attention"
            )


def _transformers_config(path: str, file: Path, model_type: str):
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"model.hf_config={path}: reading a Hugging Face config needs transformers (the `hf` extra: "
            "pip install 'tpbench[hf]')"
        ) from None
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": getattr(transformers, "Qwen3Config", None),
        "minimind": transformers.PretrainedConfig,
    }
    if classes[model_type] is None:
        raise ConfigError(f"model.hf_config={path}: model_type qwen3 needs transformers >= 4.51")
    try:
        return classes[model_type].from_json_file(str(file))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.hf_config={path}: transformers refuses it ({e})") from None


def _rope(path: str, config, model_type: str) -> dict[str, object]:
    """RoPE's theta and, for Llama-3.1's scaling (rope_type llama3), its four numbers. transformers 5
    keeps them in rope_parameters, 4.x in rope_theta and rope_scaling."""
    if model_type == "minimind":
        return {"rope_theta": float(getattr(config, "rope_theta", MINIMIND_DEFAULTS["rope_theta"]))}
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if _refuse_rope_type(path, params) == "default":
        return {"rope_theta": float(theta)}
    return {
        "rope_theta": float(theta),
        "rope_scaling_factor": float(params["factor"]),
        "rope_low_freq_factor": float(params["low_freq_factor"]),
        "rope_high_freq_factor": float(params["high_freq_factor"]),
        "rope_original_max_position_embeddings": int(params["original_max_position_embeddings"]),
    }


def _refuse_rope_type(path: str, params: dict) -> str:
    """The RoPE's type (rope_scaling's or rope_parameters'), refused unless the plain one or Llama-3.1's."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(
            f"model.hf_config={path}: rope_scaling.rope_type={rope_type!r}; accepted are the plain RoPE and "
            "Llama-3.1's (llama3)"
        )
    return rope_type
