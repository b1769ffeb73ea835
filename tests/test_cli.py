"""The command line without launching: configs, sweep expansion, bad input, help.

Bad input must be one line on stderr naming the value and what is accepted, exit code 2, nothing
launched and nothing written (the database is not even created).
"""

from __future__ import annotations

import tempfile

import pytest
import yaml
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.config import RunConfig, load_run_config, save_run_config

runner = CliRunner()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run the CLI in an empty folder; job folders would land in jobs/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobs").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "jobs"))
    return tmp_path


def nothing_written(workdir) -> bool:
    """No database (not even its folder) and no job folder."""
    return not (workdir / "runs").exists() and not list((workdir / "jobs").glob("tpbench-job-*"))


def documents(text: str) -> list[dict]:
    return list(yaml.safe_load_all(text))


BAD_INPUT = {
    "unknown key": (["foo=1"], "foo=1: foo is not a tpbench setting"),
    "unknown nested key": (["model.colour=red"], "model.colour=red: model.colour is not a tpbench setting"),
    "wrong type": (["tp=abc"], "tp=abc: parallel.tp takes int"),
    "not a bool": (["sp=maybe"], "sp=maybe: parallel.sp takes bool"),
    "zero ranks": (["tp=0"], "parallel.tp=0: accepted are integers >= 1"),
    "bad dtype": (["dtype=float8"], "train.dtype='float8': accepted are 'float32', 'bfloat16', 'float16'"),
    "bad precision": (["precision=half"], "train.precision='half': accepted are 'pure', 'mixed'"),
    "bad batch policy": (["batch=bogus"], "batch=bogus: accepted are fixed_global, fixed_per_rank"),
    "bad kind": (["kind=bogus"], "kind=bogus: accepted are all, memory, throughput, validate"),
    "bad mode": (["mode=bogus"], "mode=bogus: accepted are ddp, dtensor_tp, dtensor_tp_sp, dtensor_tp_sp_vp"),
    "bad fault": (["+fault=bogus"], "fault=bogus: accepted are big_result, hang_on_rank1, kill_on_rank1"),
    "fault without +": (["fault=raise_on_rank1"], "To append to your default list use +fault=raise_on_rank1"),
    "not an override": (["tp=="], "tp==: not an override KEY=VALUE"),
    "heads over tp": (["tp=3"], "parallel.tp=3 does not divide model.num_attention_heads=8"),
    "sp needs seq % tp": (["sp=true", "seq=33"], "train.seq_len=33 is not divisible by parallel.tp=2"),
    "tp and kv heads": (
        ["tp=8", "hidden=96", "heads=24", "kv_heads=3"],
        "parallel.tp=8 with model.num_key_value_heads=3: accepted are tp dividing the KV heads",
    ),
    "ddp with tp": (["mode=ddp", "tp=2"], "parallel.engine=ddp with tp=2"),
    "dtensor and kv heads": (
        ["mode=dtensor_tp", "tp=8", "kv_heads=2"],
        "parallel.engine=dtensor with model.num_key",
    ),
    "db url": (["db.url=::nope"], "db.url='::nope': not a SQLAlchemy URL"),
    "db driver": (
        ["db.url=nosuchdb://x/y"],
        "db.url='nosuchdb://x/y': not a SQLAlchemy URL with an installed driver",
    ),
    "multinode without endpoint": (
        ["launcher=multinode"],
        "launch.nnodes=2 needs launch.rdzv_endpoint=HOST:PORT",
    ),
    "elastic node range": (["launch.nnodes=1:4"], "launch.nnodes='1:4': accepted are node counts"),
    "oom without a cap": (["+fault=oom_on_rank1", "launch.memory_cap_mb=0"], "needs a cap to exceed"),
    "a sweep given to run": (["layers=1,2"], "a sweep of 2 configs, `tpbench run` runs one"),
}


@pytest.mark.parametrize("overrides, says", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_one_line_exit_2_and_nothing_written(workdir, overrides, says):
    done = runner.invoke(app, ["run", "kind=validate", *overrides])
    assert done.exit_code == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr
    assert nothing_written(workdir)


def test_a_bad_value_anywhere_in_a_sweep_stops_it_before_launch(workdir):
    done = runner.invoke(app, ["sweep", "kind=validate", "tp=1,2,3"])
    assert done.exit_code == 2 and "parallel.tp=3 does not divide" in done.stderr
    assert nothing_written(workdir)


def test_cfg_prints_the_resolved_config_and_runs_nothing(workdir):
    done = runner.invoke(
        app, ["run", "--cfg", "kind=validate", "mode=tp_sp_vp", "layers=4", "dtype=bfloat16"]
    )
    assert done.exit_code == 0, done.stderr
    (cfg,) = documents(done.stdout)
    assert cfg["parallel"] | {"sp_regather": True} == cfg["parallel"]
    assert (cfg["parallel"]["tp"], cfg["parallel"]["sp"], cfg["parallel"]["vp"]) == (2, True, True)
    assert cfg["model"]["num_hidden_layers"] == 4 and cfg["train"]["dtype"] == "bfloat16"
    assert (cfg["launch"]["device"], cfg["launch"]["backend"]) == ("cpu", "gloo")  # auto, resolved here
    assert nothing_written(workdir)


def test_sweep_expands_the_cartesian_product_in_order(workdir):
    done = runner.invoke(app, ["sweep", "--cfg", "kind=validate", "layers=1,2", "mode=ddp,tp,tp_sp"])
    assert done.exit_code == 0, done.stderr
    got = [
        (d["model"]["num_hidden_layers"], d["parallel"]["engine"], d["parallel"]["tp"], d["parallel"]["sp"])
        for d in documents(done.stdout)
    ]
    assert got == [
        (1, "ddp", 1, False), (1, "megatron", 2, False), (1, "megatron", 2, True),
        (2, "ddp", 1, False), (2, "megatron", 2, False), (2, "megatron", 2, True),
    ]  # fmt: skip
    assert {d["sweep"] for d in documents(done.stdout)} == {"kind=validate layers=1,2 mode=ddp,tp,tp_sp"}


def test_a_preset_sweeps_its_axes_and_the_command_line_wins(workdir):
    done = runner.invoke(app, ["sweep", "--cfg", "+preset=seed_check", "mode=tp,tp_vp", "validate.steps=3"])
    assert done.exit_code == 0, done.stderr
    docs = documents(done.stdout)
    assert [(d["parallel"]["sp"], d["parallel"]["vp"]) for d in docs] == [(False, False), (False, True)]
    for d in docs:
        assert d["sweep"] == "seed_check" and d["kind"] == "validate" and d["validate"]["steps"] == 3
        assert (d["model"]["hidden_size"], d["model"]["num_hidden_layers"], d["train"]["seq_len"]) == (
            128,
            6,
            256,
        )


def test_strings_survive_the_config_file_verbatim(tmp_path):
    cfg = RunConfig()
    cfg.model.name = """it's a "tiny"; echo $HOME && rm -rf nothing ${oc.env:HOME}"""
    cfg.sweep = "a\nb: c # d"
    save_run_config(cfg, tmp_path / "config.yaml")
    assert load_run_config(str(tmp_path / "config.yaml")) == cfg


@pytest.mark.parametrize("command", [["run"], ["sweep"], ["runs"], ["runs", "show"]])
def test_every_command_has_help_with_an_example(command):
    done = runner.invoke(app, [*command, "--help"])
    assert done.exit_code == 0 and "Examples" in done.stdout and "tpbench " + command[0] in done.stdout


def test_listing_a_missing_database_creates_nothing(workdir):
    done = runner.invoke(app, ["runs"])
    assert done.exit_code == 0 and "no database" in done.stderr
    assert nothing_written(workdir)
