"""`model.hf_config=`: a field config.json leaves out takes transformers' class default, and says so in
one line on stderr; head_dim is the class's, whatever the family (issue 35)."""

from __future__ import annotations

import pytest
from test_hf_config import PUBLISHED, write

from tpbench.models.hf_config import model_fields

pytest.importorskip("transformers")


def test_a_missing_field_is_the_classs_default_and_named_on_stderr(tmp_path, capsys):
    raw = {k: v for k, v in PUBLISHED["llama3_8b"].items() if k != "intermediate_size"}
    raw |= {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4}
    fields = model_fields(write(tmp_path, raw, "small"))
    assert fields["intermediate_size"] == 11008  # LlamaConfig's default, whatever hidden_size is
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "not in the file, so LlamaConfig's defaults: intermediate_size=11008" in said[0]


def test_a_published_config_states_every_field_so_nothing_is_said(tmp_path, capsys):
    model_fields(write(tmp_path, PUBLISHED["qwen3_0_6b"], "qwen3"))
    assert capsys.readouterr().err == ""


def test_qwen3_without_head_dim_takes_qwen3configs(tmp_path, capsys):
    raw = {k: v for k, v in PUBLISHED["qwen3_0_6b"].items() if k != "head_dim"}
    raw |= {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert model_fields(write(tmp_path, raw, "q"))["head_dim"] == 128  # not 256 / 4
    assert "head_dim=128" in capsys.readouterr().err
    llama = {k: v for k, v in PUBLISHED["llama3_8b"].items() if k != "head_dim"}
    assert model_fields(write(tmp_path, llama, "l"))["head_dim"] is None  # LlamaConfig's: H / heads
