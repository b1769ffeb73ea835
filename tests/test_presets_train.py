"""A real model's preset brings the training it is trained with (issue 35): bf16 under mixed precision,
a stated sequence length and micro-batch (conf/model/*.yaml, each with its source), while the tiny
default and MiniMind's presets keep fp32, S 32, micro-batch 2; `plan`'s title states all four. In one
process, composing without launching."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.run.compose import expand

TRAINED = {  # model: (seq, micro-batch), as conf/model/NAME.yaml gives them, with their sources
    "llama3_8b": (8192, 1),
    "llama3_70b": (8192, 8),
    "llama3_405b": (8192, 2),
    "qwen2_5_7b": (4096, 2),
    "qwen3_0_6b": (4096, 4),
    "qwen3_8b": (4096, 2),
    "qwen3_32b": (4096, 2),
}


def _train(*overrides: str) -> tuple:
    (cfg,) = expand(["kind=memory", *overrides])
    t = cfg.train
    return t.seq_len, t.micro_batch, t.dtype, t.precision


@pytest.mark.parametrize("model", sorted(TRAINED))
def test_a_real_models_preset_brings_its_training(model):
    assert _train(f"model={model}", "tp=4") == (*TRAINED[model], "bfloat16", "mixed")


@pytest.mark.parametrize("model", ["", "model=minimind", "model=minimind2", "model=minimind2_small"])
def test_the_tiny_default_and_minimind_keep_theirs(model):
    assert _train(*filter(None, [model])) == (32, 2, "float32", "pure")


def test_what_the_command_line_gives_wins():
    given = ("model=llama3_8b", "seq=1024", "micro_batch=3", "dtype=float16")
    assert _train(*given) == (1024, 3, "float16", "mixed")
    assert _train("model=llama3_8b", "dtype=float32", "precision=pure")[2:] == ("float32", "pure")


def test_plans_title_states_seq_micro_batch_dtype_and_precision():
    shown = CliRunner().invoke(app, ["plan", "model=llama3_8b", "tp=8"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.stderr
    title = (
        "llama3_8b tp tp=8 dp=1 (L32 H4096 I14336 heads 32/8 head_dim 128 V128256 theta 500000 untied) "
        "seq 8192 micro-batch 1 bfloat16 mixed: predicted memory per rank"
    )
    assert title in " ".join(shown.stdout.split())  # rich wraps a title to its table's width
