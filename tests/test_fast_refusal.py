"""A one-line refusal is printed before torch is imported (issue 35): tpbench.run.compose and what it
imports are torch-free, torch loading only once every check has passed. Run as a user runs it, in a
fresh interpreter, with `-X importtime` listing every module that loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _imported(args: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {**os.environ, "COLUMNS": "300"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tpbench", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = done.stderr.splitlines()
    modules = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    said = [line for line in lines if not line.startswith("import time:")]
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, "\n".join(said)), modules


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["run", "layers=0"], "model.num_hidden_layers=0: accepted are integers >= 1"),
        (["sweep", "tp=3"], "parallel.tp=3 does not divide model.num_attention_heads=8"),
        (["run", "dp_shard=bogus"], "parallel.dp_shard='bogus': accepted are"),
        (["run", "debug.dropout_fault=x"], "debug.dropout_fault='x': accepted are"),
        (["run", "+fault=nope"], "fault=nope: accepted are big_result"),
        (["run", "launch.emulate=odd"], "launch.emulate='odd': accepted are"),
    ],
)
def test_a_refusal_prints_before_torch_loads(args, said):
    done, modules = _imported(args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(said) and len(done.stderr.splitlines()) == 1, done.stderr
    assert "tpbench.run.compose" in modules  # the check ran, in this process
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}


def test_torch_loads_once_the_checks_pass():
    """The mechanism's other side: a config that passes every check resolves its device with torch."""
    done, modules = _imported(["run", "--cfg", "layers=2"])
    assert done.returncode == 0, done.stderr
    assert "torch" in modules
