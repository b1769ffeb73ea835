"""A one-line refusal is printed before torch is imported (issue 35): tpbench.run.compose and what it
imports are torch-free, torch loading only once every check has passed. Run as a user runs it, in a
fresh interpreter, with `-X importtime` listing every module that loads."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime

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


def test_torch_loads_once_the_checks_pass_where_a_gpu_may_be():
    """The mechanism's other side: a config that passes every check resolves its device, with torch
    where this machine has a GPU's device file (without one, torch would count none)."""
    from tpbench import machine

    done, modules = _imported(["run", "--cfg", "layers=2"])
    assert done.returncode == 0, done.stderr
    assert "device: cpu" in done.stdout or "device: cuda" in done.stdout
    assert ("torch" in modules) == any(os.path.exists(f) for f in machine.GPU_DEVICE_FILES)


def test_a_sweep_that_only_skips_launches_nothing_and_loads_no_torch(tmp_path):
    """Every config already OK in the database: the sweep said so in 9-11 s of wall, 5 of CPU, having
    imported torch, the time model (torch's MemTracker, dynamo) and torchrun's launcher for nothing."""
    from tpbench import machine
    from tpbench.db import ResultsDB
    from tpbench.results import Environment, Outcome, Status
    from tpbench.run.compose import expand

    swept = ["kind=memory", "dp=2", "dp_shard=none,optimizer", f"db.url=sqlite:///{tmp_path}/runs.db"]
    db = ResultsDB(swept[-1].removeprefix("db.url="))
    for cfg in expand(swept, single=False):
        name, count = machine.here(cfg)
        env = Environment("host", cfg.launch.device, name, count, "gloo", "2.x", None, None, None)
        db.record(cfg, Outcome(Status.OK, datetime.now(), datetime.now(), env))
    done, modules = _imported(["sweep", *swept])
    assert done.returncode == 0, done.stderr
    assert "skipped 2" in done.stderr and done.stdout.count("skipped") == 2
    assert not modules & {"tpbench.run.batch", "tpbench.run.launch", "tpbench.sizing.estimate"}
    if not any(os.path.exists(f) for f in machine.GPU_DEVICE_FILES):  # else torch counts the GPUs
        assert "torch" not in modules
