"""model.hf_config: a model's shape from a Hugging Face config.json, read with transformers' classes.

The config.json files are written here from the published ones' values (each model's Hugging Face repo),
and each must give exactly the preset of conf/model/ with that model's shape."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.config import ConfigError, ModelConfig
from tpbench.models.hf_config import model_fields
from tpbench.run import compose

pytest.importorskip("transformers")

LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# the published config.json files' fields (torch_dtype, token ids and the like left out)
PUBLISHED = {
    "llama3_8b": {  # meta-llama/Llama-3.1-8B
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": LLAMA31_ROPE,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    "qwen2_5_7b": {  # Qwen/Qwen2.5-7B
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "qwen3_0_6b": {  # Qwen/Qwen3-0.6B
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "minimind": {  # jingyaogong/minimind: MiniMindConfig's own dense defaults, its MoE fields unused
        "architectures": ["MiniMindForCausalLM"],
        "model_type": "minimind",
        "hidden_size": 768,
        "num_hidden_layers": 8,
        "use_moe": False,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "vocab_size": 6400,
        "flash_attn": True,
    },
}


def write(tmp_path, fields: dict, name: str = "model") -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder)


def preset(name: str) -> ModelConfig:
    (cfg,) = [c for c in compose.expand([f"model={name}", "kind=memory"])]
    return cfg.model


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_config_gives_its_preset(tmp_path, name):
    path = write(tmp_path, PUBLISHED[name], name)
    (cfg,) = compose.expand([f"model.hf_config={path}", "kind=memory"])
    want = dataclasses.replace(preset(name), hf_config=path)
    assert cfg.model == want


def test_overrides_given_beside_it_win(tmp_path):
    path = write(tmp_path, PUBLISHED["llama3_8b"])
    (cfg,) = compose.expand([f"model.hf_config={path}", "layers=2", "kind=memory"])
    assert (cfg.model.num_hidden_layers, cfg.model.hidden_size, cfg.model.qk_norm) == (2, 4096, False)


def test_a_file_path_works_as_the_folder(tmp_path):
    path = write(tmp_path, PUBLISHED["qwen3_0_6b"])
    assert model_fields(f"{path}/config.json")["head_dim"] == 128
    assert model_fields(f"{path}/config.json")["name"] == "model"


REFUSED = [
    ("llama3_8b", {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type='mistral'"),
    ("llama3_8b", {"architectures": ["LlamaForSequenceClassification"]}, "architectures="),
    ("qwen2_5_7b", {"use_sliding_window": True}, "use_sliding_window=true asks for a sliding window"),
    ("qwen3_0_6b", {"layer_types": ["sliding_attention"] * 28}, "layer_types="),
    ("qwen3_0_6b", {"num_experts": 128, "num_experts_per_tok": 8}, "num_experts=128 asks for experts"),
    ("minimind", {"use_moe": True}, "use_moe=true asks for experts (MoE)"),
    ("llama3_8b", {"cross_attention_layers": [3, 8]}, "cross_attention_layers=[3, 8] asks for cross-"),
    ("llama3_8b", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama3_8b", {"mlp_bias": True}, "mlp_bias=True"),
    ("llama3_8b", {"attention_bias": True}, "attention_bias=True"),  # o_proj's bias too
    ("qwen3_0_6b", {"attention_bias": True}, "attention_bias=True"),
    ("llama3_8b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
]


@pytest.mark.parametrize("name, change, said", REFUSED, ids=[r[2].split("=")[0] for r in REFUSED])
def test_what_the_dense_model_cannot_be_is_refused_naming_the_field(tmp_path, name, change, said):
    path = write(tmp_path, PUBLISHED[name] | change)
    with pytest.raises(ConfigError) as e:
        compose.expand([f"model.hf_config={path}", "kind=memory"])
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_missing_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        compose.expand([f"model.hf_config={tmp_path}", "kind=memory"])


def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path):
    path = write(tmp_path, PUBLISHED["qwen3_0_6b"] | {"num_experts": 64})
    result = CliRunner().invoke(app, ["run", f"model.hf_config={path}", "--cfg"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "num_experts=64" in result.stderr


def test_the_path_is_not_part_of_the_config_hash(tmp_path):
    from tpbench.config import config_hash

    path = write(tmp_path, PUBLISHED["qwen2_5_7b"])
    # as the preset trains it
    trained = ["seq=4096", "micro_batch=2", "dtype=bfloat16", "precision=mixed", "train.grad_clip=1.0"]
    (read,) = compose.expand([f"model.hf_config={path}", "kind=memory", *trained])
    (named,) = compose.expand(["model=qwen2_5_7b", "kind=memory"])
    named.model.name = read.model.name
    assert config_hash(read) == config_hash(named)


def test_a_yarn_config_is_refused_before_transformers_warns_of_it(tmp_path, capfd, caplog):
    """A YaRN rope_scaling printed transformers' warning on its fields before tpbench's one-line
    refusal: the RoPE's type is read from the file first."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    path = write(tmp_path, PUBLISHED["qwen3_0_6b"] | {"rope_scaling": yarn})
    with pytest.raises(ConfigError, match="rope_scaling.rope_type='yarn'; accepted are the plain RoPE"):
        model_fields(str(path))
    assert capfd.readouterr().err == "" and not [r for r in caplog.records if "transformers" in r.name]
