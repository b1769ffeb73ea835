"""What a newcomer meets in the first hour (issue 35): overrides that are contradictions or do nothing
refused in one line, a guess for a mistyped key, one spelling of the database and of sweep names,
help texts as written. In one process, composing without launching."""

from __future__ import annotations

import pytest
from test_db import config, outcome
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.config import ConfigError, mode_label
from tpbench.db import ResultsDB
from tpbench.run import sweep
from tpbench.run.compose import expand


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        expand(overrides)
    return str(e.value)


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), prog_name="tpbench", env={"COLUMNS": "300"})


def test_a_mode_and_a_switch_it_sets_otherwise_are_refused():
    said = _refusal(["mode=tp_sp_vp", "sp=false"])
    assert said.startswith("mode=tp_sp_vp with parallel.sp=false: mode=tp_sp_vp sets parallel.sp=true;")
    assert "dp=1" not in said
    assert "engine=ddp" in _refusal(["mode=tp", "engine=ddp"])
    # the mode's sizes may change, its switches be restated, a switch set without a mode
    assert {mode_label(c.parallel) for c in expand(["mode=tp_sp_vp", "tp=4", "sp=true"])} == {"tp_sp_vp"}
    assert {mode_label(c.parallel) for c in expand(["sp=true", "vp=true"])} == {"tp_sp_vp"}


def test_cfg_heads_each_config_with_its_mode():
    shown = _invoke("run", "--cfg", "mode=tp_vp").stdout
    assert shown.startswith("# mode=tp_vp\n")


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("~model.dropout", "~model.dropout: removes a setting"),
        ("hydra.run.dir=/tmp/x", "hydra.run.dir=/tmp/x: Hydra's own setting, which tpbench never reads"),
        ("layer=4", "layer=4: layer is not a tpbench setting (did you mean layers?)"),
        ("model.hiden_size=8", "model.hiden_size is not a tpbench setting (did you mean model.hidden_size?)"),
    ],
)
def test_an_override_that_would_do_nothing_is_one_line(override, said):
    assert said in _refusal([override])


@pytest.mark.parametrize("flag", ["-m", "--multirun"])
def test_hydras_multirun_points_to_sweep(flag):
    result = _invoke("run", flag, "tp=2,4")
    assert result.exit_code == 2
    assert "`tpbench sweep`" in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_sweeps_automatic_name_leaves_where_it_records_out():
    configs = expand(["layers=1,2", "db.url=sqlite:////tmp/x.db"])
    sweep.name(configs, None, ["layers=1,2", "db.url=sqlite:////tmp/x.db"])
    assert {c.sweep for c in configs} == {"layers=1,2"}


def test_runs_sweep_matches_a_name_else_a_prefix(tmp_path):
    db = ResultsDB(f"sqlite:///{tmp_path / 't.db'}")
    for seed, name in enumerate(["layers=1,2 mode=tp,tp_sp", "layers=1,2 mode=tp,tp_sp", "layers", "other"]):
        cfg = config(seed)
        cfg.sweep = name
        db.record(cfg, outcome(seed=seed))
    assert db.runs(sweep="layers=1,2").id.tolist() == [1, 2]
    assert db.runs(sweep="layers").id.tolist() == [3]  # a name of its own is that sweep alone
    assert db.runs(sweep="layers=1,2 mode=tp,tp_sp").id.tolist() == [1, 2]
    assert db.runs(sweep="x").empty


def test_runs_status_takes_any_case_and_its_help_every_status(tmp_path):
    from tpbench.results import Status

    url = f"sqlite:///{tmp_path / 'none.db'}"
    assert _invoke("runs", "--status", "ok", "--db", url).exit_code == 0  # no database yet: said, exit 0
    assert _invoke("runs", "--status", "done", "--db", url).exit_code == 2
    shown = " ".join(_invoke("runs", "--help").stdout.split())
    assert all(status in shown for status in Status)


@pytest.mark.parametrize(
    ("command", "text"),
    [
        ("diagram", "math view W [in, out] and nn.Linear view [out, in]"),
        ("sweep", "[default: the preset's name"),
    ],
)
def test_help_keeps_its_square_brackets(command, text):
    assert text in " ".join(_invoke(command, "--help").stdout.split())


def test_run_says_once_where_it_records(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "run_each", lambda *a, **k: iter(()))  # composed and opened, not launched
    url = f"sqlite:///{tmp_path / 'here.db'}"
    result = _invoke("run", "kind=validate", f"db.url={url}")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines().count(f"recording in {url}") == 1


def test_runs_show_gives_the_batch_the_run_trained_with(tmp_path):
    import json

    url = f"sqlite:///{tmp_path / 't.db'}"
    db = ResultsDB(url)
    per_rank = config(0)  # fixed_per_rank, micro_batch 2, global_batch 4 as given
    per_rank.parallel.dp = 3
    global_ = config(1)
    global_.train.batch, global_.train.global_batch, global_.parallel.dp = "fixed_global", 12, 2
    ids = [db.record(c, outcome(seed=i)) for i, c in enumerate([per_rank, global_])]
    shown = [json.loads(_invoke("runs", "show", str(i), "--json", "--db", url).stdout) for i in ids]
    assert [(s["micro_batch"], s["global_batch"]) for s in shown] == [(2, 6), (6, 12)]
    text = _invoke("runs", "show", str(ids[0]), "--db", url).stdout
    assert any(line.split() == ["│", "global_batch", "│", "6", "│"] for line in text.splitlines()), text


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--out", "rep.txt"], "--out rep.txt: the extension .txt is no format written; accepted are .html"),
        (["--out", "rep.md", "--format", "html"], "--out rep.md with --format html: the extension says md"),
        (["--format", "pdf"], "--format pdf: accepted are html, md, csv, json"),
    ],
)
def test_report_out_and_format_agree_or_are_refused(tmp_path, args, said):
    result = _invoke("report", *args, "--db", f"sqlite:///{tmp_path / 'none.db'}")
    assert result.exit_code == 2 and said in result.stderr and len(result.stderr.splitlines()) == 1


def test_report_and_diagram_follow_outs_extension(tmp_path, monkeypatch):
    from tpbench import diagram, report

    written = {}
    monkeypatch.setattr(report, "write", lambda db, sel, fmt, out: written.setdefault("report", fmt))
    monkeypatch.setattr(diagram, "render", lambda traced, fmt: written.setdefault("diagram", fmt).encode())
    monkeypatch.setattr(diagram, "trace", lambda c: c)
    url = f"sqlite:///{tmp_path / 't.db'}"
    ResultsDB(url).record(config(), outcome())
    assert _invoke("report", "--out", str(tmp_path / "rep.md"), "--db", url).exit_code == 0
    assert _invoke("diagram", "tp=2", "--out", str(tmp_path / "block.png")).exit_code == 0
    assert written == {"report": "md", "diagram": "png"}
    assert _invoke("diagram", "--format", "png", "--out", str(tmp_path / "b.svg")).exit_code == 2


def _fit(*overrides: str):
    from tpbench.sizing import fit

    request = fit.parse(list(overrides))
    (base,) = expand(request.overrides, single=True)
    return fit.solve(request, base)


def test_fit_honours_a_mode_and_a_micro_batch():
    layouts = {(r.sp, r.vp) for r in _fit("model=qwen3_0_6b", "seq=1024", "gpu=H200", "mode=tp_sp").rows}
    assert layouts == {(True, False)}  # T searched, SP on and VP off as the mode says
    rows = _fit("model=qwen3_0_6b", "seq=1024", "gpu=H200", "micro_batch=4").rows
    assert {r.micro_batch for r in rows} == {4} and not any(r.capped for r in rows)  # 4, not "4+"


@pytest.mark.parametrize(
    ("override", "said"),
    [
        (
            "dp=2",
            "dp=2: fit sets DP itself (the GPUs, nodes x gpus_per_node, over T); accepted are nodes=N",
        ),
        ("mode=ddp", "mode=ddp: fit takes one tensor-parallel mode"),
    ],
)
def test_fit_refuses_what_it_cannot_honour(override, said):
    result = _invoke("fit", "model=qwen3_0_6b", "seq=1024", "gpu=H200", override)
    assert result.exit_code == 2 and said in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_run_and_sweep_take_db_as_runs_and_report_do(tmp_path, monkeypatch, command):
    monkeypatch.setattr(sweep, "run_each", lambda *a, **k: iter(()))  # composed and opened, not launched
    url = f"sqlite:///{tmp_path / 'here.db'}"
    result = _invoke(command, "kind=validate", "--db", url)
    assert result.exit_code == 0, result.stderr
    assert f"recording in {url}" in result.stderr.splitlines()
    twice = _invoke(command, "kind=validate", "--db", url, f"db.url={url}")
    assert twice.exit_code == 2 and f"--db {url} with db.url={url}: accepted is" in twice.stderr
