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


def test_the_resolved_shape_is_in_every_title_that_names_the_model(tmp_path):
    """What config.json left out (the MLP width, tying, theta) shows where the model is named: plan's
    and fit's titles, the validation's table (a run's stored text) and `runs show`."""
    from test_db import config, outcome
    from typer.testing import CliRunner

    from tpbench.cli import app
    from tpbench.config import ModelConfig
    from tpbench.db import ResultsDB
    from tpbench.experiments.criterion import table

    raw = {k: v for k, v in PUBLISHED["llama3_8b"].items() if k != "intermediate_size"}
    raw |= {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4}
    path = write(tmp_path, raw, "small")
    shape = "L4 H256 I11008 heads 8/2 head_dim 32 V128256 theta 500000 untied"

    def shown(*args: str) -> str:
        done = CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})
        assert done.exit_code == 0, done.stderr
        return " ".join(done.stdout.split())  # rich wraps a title to its table's width

    assert f"({shape}) seq 32 micro-batch 2" in shown("plan", f"model.hf_config={path}", "tp=2")
    fitted = shown(
        "fit", f"model.hf_config={path}", "seq=1024", "gpu=H100", "precision=mixed", "dtype=bfloat16"
    )
    assert f"({shape}) S 1024, mixed precision" in fitted
    cfg = config(0)
    cfg.model = ModelConfig(**{**model_fields(path), "hf_config": str(path)})
    assert f"{shape} seq {cfg.train.seq_len}" in " ".join(table(cfg, [], [], passed=True).split())
    url = f"sqlite:///{tmp_path / 't.db'}"
    run_id = ResultsDB(url).record(cfg, outcome())
    assert f"│ model │ {cfg.model.name} {shape} │" in shown("runs", "show", str(run_id), "--db", url)
