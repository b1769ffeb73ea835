"""The command line without launching: configs, sweep expansion, bad input, help.

Bad input must be one line on stderr naming the value and what is accepted, exit code 2, nothing
launched and nothing written (the database is not even created).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

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
    "bad fault": (["+fault=bogus"], "fault=bogus: accepted are big_result, hang_in_dp_group"),
    "fault without +": (["fault=raise_on_rank1"], "fault=raise_on_rank1: fault is a group added with +"),
    "bad fault without +": (["fault=no"], "fault=no: fault is a group added with +; accepted are +fault=big"),
    "preset without +": (["preset=x"], "preset=x: preset is a group added with +; accepted are +preset=seed"),
    "not an override": (["tp=="], "tp==: not an override KEY=VALUE"),
    "heads over tp": (["tp=3"], "parallel.tp=3 does not divide model.num_attention_heads=8"),
    "sp needs seq % tp": (["sp=true", "seq=33"], "train.seq_len=33 is not divisible by parallel.tp=2"),
    "tp and kv heads": (
        ["tp=8", "hidden=96", "heads=24", "kv_heads=3"],
        "parallel.tp=8 with model.num_key_value_heads=3: accepted are tp dividing the KV heads",
    ),
    "ddp with tp": (
        ["mode=ddp", "tp=2"],
        "mode=ddp with tp=2: DDP keeps the whole model on every rank; accepted are tp=1, sp=false, vp=false",
    ),
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
    "a bad key beside a sweep given to run": (["layers=1,2", "foo=1"], "foo=1: foo is not a tpbench setting"),
    # keys outside the schema, booleans, paths, and the rest of the class
    "an added key": (["+anything=1"], "+anything=1: anything is not a tpbench setting and cannot be added"),
    "an added nested key": (["+model.colour=red"], "model.colour is not a tpbench setting"),
    "an int for a bool": (["vp=2"], "vp=2: parallel.vp takes bool: accepted are true, false"),
    "yes for a bool": (["sp=yes"], "sp=yes: parallel.sp takes bool"),
    "an int in a bool sweep": (["vp=true,2"], "parallel.vp takes bool"),
    "an int for a bool key": (["model.flash_attn=1"], "model.flash_attn takes bool"),
    "a db path that cannot be": (
        ["db.url=sqlite:////etc/hostname/x.db"],
        "cannot create the folder /etc/hostname",
    ),
    "a db driver not installed": (["db.url=mysql://u@h/x"], "not a SQLAlchemy URL with an installed driver"),
    "pure fp16": (["dtype=float16"], "AdamW's eps (1e-8) underflows to 0 in fp16"),
    "mixed fp32": (["precision=mixed"], "train.precision=mixed with train.dtype=float32"),
    "nan timeout": (["launch.collective_timeout_s=nan"], "accepted are finite numbers > 0"),
    "inf timeout": (["launch.job_timeout_s=inf"], "launch.job_timeout_s=inf: accepted are finite"),
    "huge timeout": (["launch.job_timeout_s=1e30"], "accepted are seconds up to 1e+07"),
    "negative lr": (["train.lr=-1"], "train.lr=-1.0: accepted are finite numbers >= 0"),
    "negative tolerance": (["validate.tol_fwd=-1"], "validate.tol_fwd=-1.0: accepted"),
    "zero rope theta": (["model.rope_theta=0"], "model.rope_theta=0.0: accepted are finite numbers > 0"),
    "zero norm eps": (["model.rms_norm_eps=0"], "model.rms_norm_eps=0.0"),
    "zero bucket": (["parallel.ddp_bucket_mb=0"], "parallel.ddp_bucket_mb=0.0"),
    "negative seed": (["train.seed=-1"], "train.seed=-1: accepted are integers >= 0"),
    "zero pad multiple": (["parallel.vocab_pad_multiple=0"], "parallel.vocab_pad_multiple=0: accepted"),
    "zero intermediate": (["model.intermediate_size=0"], "model.intermediate_size=0: accepted"),
    "zero ranks per node": (["launch.nproc_per_node=0"], "launch.nproc_per_node=0: accepted"),
    "odd head dim": (["hidden=72"], "odd head dim"),
    # the families' switches
    "odd given head dim": (["model.head_dim=15"], "model.head_dim=15 is odd"),
    "zero head dim": (["model.head_dim=0"], "model.head_dim=0: accepted are integers >= 1"),
    "H not a head multiple": (
        ["hidden=68"],
        "model.hidden_size=68 is not divisible by model.num_attention_heads=8",
    ),
    "zero rope scaling": (
        ["model.rope_scaling_factor=0"],
        "model.rope_scaling_factor=0.0: accepted are finite",
    ),
    "rope bands crossed": (
        ["model.rope_scaling_factor=8", "model.rope_low_freq_factor=4", "model.rope_high_freq_factor=1"],
        "model.rope_high_freq_factor=1.0 with model.rope_low_freq_factor=4.0: ",
    ),
    "dp hang without dp": (["+fault=hang_in_dp_group"], "fault=hang_in_dp_group needs parallel.dp >= 2"),
    "kv hang without replicas": (["+fault=hang_in_kv_group"], "needs parallel.tp > model.num_key_value"),
    "unknown sp gather": (["parallel.sp_gather=rows"], "parallel.sp_gather='rows': accepted are 'region'"),
    "sp gather without sp": (
        ["mode=tp", "parallel.sp_gather=linear"],
        "parallel.sp_gather=linear with engine=megatron sp=false: ",
    ),
    "sp gather on dtensor": (
        ["mode=dtensor_tp_sp", "parallel.sp_gather=linear"],
        "parallel.sp_gather=linear with engine=dtensor sp=true: ",
    ),
    "compile with the re-gather": (
        ["mode=tp_sp", "compile=true"],
        "train.compile=true with parallel.sp_regather",
    ),
    "compile on an emulated rank": (
        ["kind=memory", "launch.emulate=real", "compile=true"],
        "train.compile=true with launch.emulate=real",
    ),
    "compile neither auto nor a bool": (["compile=yes"], "train.compile=yes: accepted are auto, true, false"),
    "eager swiglu recomputed": (
        ["model.fused_swiglu=false", "recompute=full"],
        "model.fused_swiglu=false with train.recompute=full: ",
    ),
    "eager rmsnorm recomputed": (
        ["model.lean_rmsnorm=false", "recompute=selective"],
        "model.lean_rmsnorm=false with train.recompute=selective: ",
    ),
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


BAD_FLAGS = {
    "runs status": (["runs", "--status", "DONE"], "--status DONE: accepted are OK, FAILED, OOM, TIMEOUT"),
    "runs kind": (["runs", "--kind", "memroy"], "--kind memroy: accepted are validate, memory, throughput"),
    "runs mode": (["runs", "--mode", "sp"], "--mode sp: accepted are ddp, dtensor_tp"),
    "runs db": (["runs", "--db", "::x"], "'::x' is not a SQLAlchemy URL"),
    "runs show db": (
        ["runs", "show", "1", "--db", "sqlite:////etc/hostname/x.db"],
        "no database at /etc/hostname/x.db yet",
    ),
    "report missing db": (
        ["report", "--db", "sqlite:///nosuch/x.db"],
        "no database at nosuch/x.db yet: `tpbench run` creates it",
    ),
    "report format": (["report", "--format", "pdf"], "--format pdf: accepted are html, md, csv, json"),
    "report kind": (["report", "--kind", "x"], "--kind x: accepted are validate"),
    "report mode": (["report", "--mode", "x"], "--mode x: accepted are ddp"),
    "report db": (["report", "--db", "nosuch://x"], "'nosuch://x' is not a SQLAlchemy URL"),
}


@pytest.mark.parametrize("args, says", BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_bad_flags_are_one_line_and_exit_2_before_any_database(workdir, args, says):
    done = runner.invoke(app, args)
    assert done.exit_code == 2, done.output
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr
    assert nothing_written(workdir)


def typer_usage_errors() -> dict[str, tuple[list[str], str]]:
    """typer's own usage errors, for every command and every option of it (read off the command tree,
    so a new option is covered): a flag given a value, an option without its value, an unknown option;
    then an unknown command, a missing, malformed or extra argument."""
    from typer.main import get_command

    cases = {}
    root = get_command(app)
    commands = [([], root)]
    while commands:
        path, command = commands.pop(0)
        name = " ".join(["tpbench", *path])
        subcommands = getattr(command, "commands", {})
        commands += [([*path, sub], cmd) for sub, cmd in subcommands.items()]
        options = [p for p in command.params if p.param_type_name == "option"]
        for option in options:
            flag = option.opts[0]
            if option.is_flag:
                cases[f"{name} {flag}=1"] = ([*path, f"{flag}=1"], f"{flag} is a flag: given alone")
            else:
                cases[f"{name} {flag}"] = (
                    [*path, flag],
                    f"Option '{flag}' requires an argument; accepted for",
                )
        accepted = ", ".join([*(o for p in options for o in p.opts), "--help"])
        cases[f"{name} --bogus"] = (
            [*path, "--bogus"],
            f"{name}: No such option: --bogus; accepted options are {accepted}",
        )
        if subcommands:
            cases[f"{name} frob"] = (
                [*path, "frob"],
                f"{name}: No such command 'frob'; accepted commands are",
            )
    cases |= {
        "show without id": (
            ["runs", "show"],
            "tpbench runs show: Missing argument 'run_id'; accepted for run_id",
        ),
        "show bad id": (["runs", "show", "abc"], "run id abc: accepted is a number"),
        "show extra id": (["runs", "show", "1", "2"], "extra argument(s) (2); usage: tpbench runs show"),
        "run typo": (
            ["run", "--josn"],
            "No such option: --josn; accepted options are --cfg, --json, --db, --help",
        ),
    }
    return cases


TYPER_USAGE = typer_usage_errors()


@pytest.mark.parametrize("args, says", TYPER_USAGE.values(), ids=TYPER_USAGE.keys())
def test_typer_usage_errors_are_one_line_and_exit_2_before_anything(workdir, args, says):
    done = runner.invoke(app, args, prog_name="tpbench")
    assert done.exit_code == 2, done.output
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    assert nothing_written(workdir)


def test_tpbench_alone_prints_the_help_not_a_usage_line():
    """No arguments: the whole help (exit 2 since click 8.2 raises it as a usage error, 0 before)."""
    done = runner.invoke(app, [], prog_name="tpbench")
    assert done.exit_code in (0, 2), done.output
    assert "Usage: tpbench [OPTIONS] COMMAND [ARGS]..." in done.stdout and done.stderr == ""
    assert len(done.stdout.splitlines()) > 10 and "sweep" in done.stdout


def test_every_command_and_option_is_covered():
    """The tree walk above reaches every command `tpbench --help` lists, and each option of theirs."""
    listed = runner.invoke(app, ["--help"]).stdout
    commands = {args[0] for args, _ in TYPER_USAGE.values() if args and not args[0].startswith("-")}
    assert {"run", "sweep", "runs", "report", "plan", "diagram"} <= commands
    assert all(c in listed for c in commands - {"frob"})
    assert "tpbench report --format" in TYPER_USAGE and "tpbench runs show --db" in TYPER_USAGE


def test_a_usage_error_is_one_line_from_the_installed_command_too(workdir):
    """The real entry point, in its own process: no box, one line, exit 2, no database."""
    done = subprocess.run(
        [Path(sys.executable).with_name("tpbench"), "report", "--format"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr.splitlines() == [
        "tpbench report: Option '--format' requires an argument; "
        "accepted for --format: html, md, csv or json."
    ]
    assert nothing_written(workdir)


def test_listing_a_missing_database_creates_nothing(workdir):
    done = runner.invoke(app, ["runs"])
    assert done.exit_code == 0 and "no database" in done.stderr
    assert nothing_written(workdir)


SLURM_BAD_INPUT = {
    "no sbatch": ([], "PATH", "launcher=slurm: no sbatch on PATH; accepted here is launcher=local"),
    "no submitit": ([], "submitit", "launcher=slurm needs submitit, which is not installed: pip install"),
    "short time limit": (
        ["launch.slurm.time_min=4"],
        "",
        "launch.slurm.time_min=4: accepted are minutes >= 5",
    ),
    "sbatch line": (
        ["launch.slurm.sbatch=['qos=high']"],
        "",
        "launch.slurm.sbatch has 'qos=high': accepted are",
    ),
    "preemption": (["launch.slurm.on_preempt=retry"], "", "launch.slurm.on_preempt='retry': accepted are"),
    "parallel jobs": (["launch.max_parallel=0"], "", "launch.max_parallel=0: accepted are integers >= 1"),
    "gpus": (
        ["device=cuda"],
        "",
        "launch.device=cuda: 2 ranks on a node need 2 GPUs, launch.slurm.gpus_per_node=0",
    ),
    "--wait without slurm": (["--wait"], "local", "--wait follows Slurm jobs: it needs launcher=slurm"),
}


@pytest.mark.parametrize("overrides, without, says", SLURM_BAD_INPUT.values(), ids=SLURM_BAD_INPUT.keys())
def test_slurm_bad_input_is_one_line_exit_2_and_nothing_written(
    workdir, monkeypatch, overrides, without, says
):
    sbatch = workdir / "bin" / "sbatch"  # submitting is never reached: any sbatch on PATH will do
    sbatch.parent.mkdir()
    sbatch.write_text("#!/bin/sh\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", str(workdir / "nothing" if without == "PATH" else sbatch.parent))
    if without == "submitit":
        monkeypatch.setitem(sys.modules, "submitit", None)
    launcher = "launcher=local" if without == "local" else "launcher=slurm"
    done = runner.invoke(app, ["sweep", "kind=validate", launcher, *overrides])
    assert done.exit_code == 2
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    assert nothing_written(workdir)


# -- hardware: one database shared by two kinds of machine (their jobs stood in for: nothing launches) --

XEON, EPYC = "Intel(R) Xeon(R) Platinum 8480+", "AMD EPYC 9B14"
SWEEP = ["sweep", "kind=validate", "layers=1,2"]


@pytest.fixture
def machines(workdir, monkeypatch):
    """`on(name)` makes this process a machine of that CPU; every job it launches is recorded OK at once
    (what the job saw: this machine). Returns on and the list of (machine, layers) launched."""
    from tpbench import machine
    from tpbench.results import Environment, Outcome, RankResult, Status
    from tpbench.run import batch, launch

    launched = []

    def run_job(cfg, on_progress):
        name, count = machine.here(cfg)
        launched.append((name, cfg.model.num_hidden_layers))
        result = RankResult(rank=0)
        result.add("passed", 1.0)
        env = Environment("host", cfg.launch.device, name, count, "gloo", "2.x", None, None, None)
        now = datetime.now(UTC).replace(tzinfo=None)
        return Outcome(Status.OK, now, now, env, [result])

    monkeypatch.setattr(launch, "run_job", run_job)
    monkeypatch.setattr(batch, "batch_key", lambda cfg: None)  # every run a job of its own: run_job's

    def on(name: str) -> None:
        monkeypatch.setattr(machine, "here", lambda cfg: (name, 2))

    return on, launched


def test_a_sweep_on_another_kind_of_machine_runs_what_the_first_recorded(machines):
    on, launched = machines
    on(XEON)
    for _ in range(2):  # the second time: both configs done on this machine, skipped
        assert runner.invoke(app, SWEEP).exit_code == 0
    on(EPYC)
    assert runner.invoke(app, SWEEP).exit_code == 0
    assert runner.invoke(app, SWEEP).exit_code == 0
    assert launched == [(XEON, 1), (XEON, 2), (EPYC, 1), (EPYC, 2)]


def hardware_of(name: str) -> str:
    return f"{name} · 2 CPU cores per node · 1 node"


def test_runs_and_report_filter_by_hardware_and_a_report_says_it_mixes_them(machines, workdir):
    on, _ = machines
    for name in (XEON, EPYC):
        on(name)
        assert runner.invoke(app, SWEEP).exit_code == 0
    listed = runner.invoke(app, ["runs", "--device", "epyc"])  # a substring, any case
    assert listed.exit_code == 0 and "2 runs in" in listed.stdout
    assert f"2 runs in sqlite:///runs/tpbench.db, all on {hardware_of(EPYC)}" in listed.stdout  # said once
    assert listed.stdout.count(EPYC) == 1 and "Xeon" not in listed.stdout
    # a --device no run has: one line naming the hardware there is, nothing written, as for no runs
    said = f"no run in sqlite:///runs/tpbench.db ran on such hardware; its hardware: {hardware_of(EPYC)}; "
    for command in (["runs"], ["report", "--out", "h100.html"]):
        done = runner.invoke(app, [*command, "--device", "H100"])
        assert done.exit_code == 0 and done.stdout == ""
        assert done.stderr.splitlines() == [f"--device H100: {said}{hardware_of(XEON)}"]
    assert not (workdir / "h100.html").exists()
    other = runner.invoke(app, ["runs", "--device", "epyc", "--kind", "memory"])  # the hardware is there
    assert other.exit_code == 0 and "0 runs in" in other.stdout and other.stderr == ""
    # the report: mixed hardware in its header, each config's latest run on each machine
    assert runner.invoke(app, ["report", "--format", "md", "--out", "all.md"]).exit_code == 0
    text = (workdir / "all.md").read_text()
    assert (
        f"Mixed hardware: these runs ran on 2 kinds of machine ({hardware_of(EPYC)}; {hardware_of(XEON)})"
        in text
    )
    assert f"| hardware | 2 kinds, mixed: {hardware_of(EPYC)}; {hardware_of(XEON)} |" in text
    assert runner.invoke(app, ["report", "--out", "all.html"]).exit_code == 0
    html = (workdir / "all.html").read_text()
    header = html[: html.index('<section id="memory">')]
    assert '<p class="intro">Mixed hardware: these runs ran on 2 kinds of machine' in header
    checks = text.split("### Checks against dense")[1].split("###")[0]
    rows = [line for line in checks.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # by setting (it ends with the hardware), then layers
    assert [row.split(" | ")[0] for row in rows] == ["| 3", "| 4", "| 1", "| 2"]
    assert sum(hardware_of(XEON) in row for row in rows) == 2
    assert (
        runner.invoke(app, ["report", "--device", "xeon", "--format", "md", "--out", "xeon.md"]).exit_code
        == 0
    )
    xeon = (workdir / "xeon.md").read_text()
    assert "Mixed hardware" not in xeon and f"| hardware | {hardware_of(XEON)} |" in xeon
    assert "hardware holding 'xeon'" in xeon and EPYC not in xeon


def test_plan_json_is_the_prediction_as_one_object():
    """`plan --json`: one JSON object a config, the prediction's figures as theory gives them."""
    import json

    from tpbench.predict import theory
    from tpbench.run.compose import expand

    overrides = ["tp=2", "sp=true", "kind=memory"]
    result = CliRunner().invoke(app, ["plan", *overrides, "--json"])
    assert result.exit_code == 0, result.output
    (line,) = result.stdout.splitlines()
    got = json.loads(line)
    (cfg,) = expand(overrides, single=True)
    prediction = theory.predict(cfg)
    assert (got["tp"], got["sp"], got["mode"]) == (2, True, "tp_sp")
    assert got["peak_bytes"] == prediction.peak_bytes and got["peak_moment"] == prediction.peak.name
    assert [m["total"] for m in got["moments"]] == [m.total for m in prediction.moments]
    assert got["comm_bytes_per_step"] == prediction.comm_bytes_per_step
    assert sum(r["bytes"] for r in got["comm"]) == prediction.comm_bytes_per_step


# -- a run's label: its DP level in every line, and `runs` at any width (issue 54, items 3 and 4) --------

LEVELS_SWEEP = ["sweep", "kind=memory", "mode=tp", "tp=2", "dp=2", "dp_shard=none,optimizer,grads,full"]
LABELS = [f"memory tp tp=2 dp=2{level} layers=2" for level in ("", " ZeRO-1", " ZeRO-2", " FSDP")]


def test_every_line_of_a_run_names_its_dp_level(machines):
    """The four levels of one sweep were four runs alike: `memory tp tp=2 dp=2 layers=2: OK` each,
    `2x2` in `runs`, `runs show` naming none. Each now names its level (DDP's replicas, the default,
    none: the others are named)."""
    on, _ = machines
    on(XEON)
    done = runner.invoke(app, LEVELS_SWEEP)
    assert done.exit_code == 0, done.output
    ended = [line.split(": OK in")[0] for line in done.stderr.splitlines() if ": OK in" in line]
    assert ended == LABELS
    assert "(memory tp tp=2 dp=2 " in done.stderr  # the sweep's estimate names its longest run
    listed = runner.invoke(app, ["runs"]).stdout
    for level in ("ZeRO-1", "ZeRO-2", "FSDP"):
        assert listed.count(f"2×2 {level}") == 1, listed
    for run_id, label in enumerate(LABELS, start=1):
        shown = runner.invoke(app, ["runs", "show", str(run_id)]).stdout
        assert f"run {run_id}: {label}" in shown and f"run {run_id} OK: {label}" in shown, shown


def test_a_label_names_hsdp_replicas_and_the_validate_table_its_level():
    from tpbench.config import run_label
    from tpbench.experiments import criterion
    from tpbench.run.compose import expand

    (hsdp,) = expand(["kind=memory", "dp=4", "dp_shard=full", "parallel.dp_replicate=2"], single=True)
    assert run_label(hsdp) == "memory tp tp=2 dp=4 FSDP (2 replicas) layers=2"
    (zero2,) = expand(["kind=validate", "dp=2", "dp_shard=grads"], single=True)
    title = criterion.table(zero2, [], [], passed=True).splitlines()[0]
    assert "validate tp  tp=2 dp=2 ZeRO-2  float32" in title


def recorded(db_url: str, count: int) -> None:
    """`count` runs in the database, as a long history has them: every status, two machines, sweeps,
    modes long and short, every DP level; recorded, not run."""
    from test_db import ENV, config, outcome

    from tpbench.db import ResultsDB
    from tpbench.results import Status

    db = ResultsDB(db_url)
    levels = ("none", "optimizer", "grads", "full")
    for i in range(count):
        cfg = config()
        cfg.parallel.dp, cfg.parallel.dp_shard = 2, levels[i % 4]
        if i % 5 == 0:
            cfg.parallel.engine, cfg.parallel.sp, cfg.parallel.vp = "dtensor", True, True
        cfg.sweep = "kind=memory tp=2 dp=2 dp_shard=none,optimizer,grads,full" if i % 2 else ""
        env = ENV if i % 3 else dataclasses.replace(ENV, device_name="AMD EPYC 9B14 96-Core Processor")
        done = outcome(Status.OK if i % 7 else Status.INTERRUPTED, env=env)
        if done.status is Status.INTERRUPTED:
            done.error = "interrupted by Ctrl-C while stepping, at step 3 of 20 on rank 1"
        db.record(cfg, done)


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> str:
    """A database of 45 runs (`recorded`), read by every width below."""
    url = f"sqlite:///{tmp_path_factory.mktemp('history')}/runs.db"
    recorded(url, 45)
    return url


@pytest.mark.parametrize("width", [80, 120, 200, None], ids=["80", "120", "200", "piped"])
def test_runs_shows_every_id_and_status_whole_at_any_width(history, monkeypatch, width):
    """Some 40 runs once made `runs` cut its ids to `…` (ids >= 10 piped; blank at 120 to 200 columns)
    and the statuses to `sta…`: `runs show ID` had no id to take. None: piped, as the command prints."""
    from rich.console import Console

    from tpbench.cli import output

    if width is not None:
        monkeypatch.setattr(output, "out", Console(width=width, markup=False, highlight=False))
    done = runner.invoke(app, ["runs", "--db", history])
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) <= (width or 200)
    first = [line.split("│")[1:3] for line in lines if line.startswith("│")]
    rows = [(cells[0].strip(), cells[1]) for cells in first if cells[0].strip()]
    assert [int(run_id) for run_id, _ in rows] == list(range(1, 46))
    statuses = [line for line in lines if "INTERRUPTED" in line]
    assert len(statuses) == 7 and "…" not in done.stdout


# -- plan's labels (issue 54, item 10) -----------------------------------------------------------------


def test_plans_split_names_the_layout_and_its_columns_add_up_to_the_peak():
    """At tp=2 dp=1 the split was titled "DDP: ...", and its master column (a part of the weights)
    was summed beside them: the columns added up to more than the peak."""
    from tpbench.cli import sharded
    from tpbench.predict import theory
    from tpbench.run.compose import expand

    for overrides, layout in ((["tp=2"], "tp=2 dp=1"), (["dp=2", "dp_shard=optimizer"], "tp=2 dp=2 ZeRO-1")):
        (cfg,) = expand(["kind=memory", *overrides], single=True)
        prediction = theory.predict(cfg)
        values = sharded.split(cfg, prediction)
        assert sum(values[k] for k in sharded.SPLIT) == prediction.peak_bytes
        shown = runner.invoke(app, ["plan", "kind=memory", *overrides]).stdout
        assert f"{layout}: the peak per rank ({prediction.peak.name}) by what holds it" in shown, shown
        assert not [line for line in shown.splitlines() if line.strip().startswith("DDP:")]


def test_plans_step_time_is_in_one_format():
    """It said "1.675e+04 ms = compute 2,144 + exposed communication 1.35e+04": one format now."""
    from types import SimpleNamespace

    from tpbench.cli import output

    assert [output.ms(s) for s in (16.75, 2.1443, 0.03678, 0.000483, 0.0)] == [
        "16,750", "2,144", "36.8", "0.483", "0",
    ]  # fmt: skip
    timed = SimpleNamespace(
        step_s=16.75, compute_s=2.144, comm_s=13.5, comm_exposed={"activation": 12.46, "loss": 0.0662},
        optimizer_s=1.161, tokens_per_s=4.0, mfu=None, host_s=0.0,
    )  # fmt: skip
    with output.out.capture() as said:
        output.step_time(RunConfig(), timed)
    assert said.get().startswith(
        "predicted step time on this CPU: 16,750 ms = compute 2,144 + exposed communication 13,500 "
        "(activation 12,460, loss 66.2) + optimizer 1,161; 4 tokens/s"
    )


def test_one_run_is_listed_as_one_run(workdir):
    recorded("sqlite:///runs/tpbench.db", 1)
    listed = runner.invoke(app, ["runs"]).stdout
    assert "1 run in sqlite:///runs/tpbench.db" in listed and "1 runs" not in listed


def test_a_sweeps_table_spells_booleans_as_overrides_do(machines):
    on, _ = machines
    on(XEON)
    done = runner.invoke(app, ["sweep", "kind=validate", "mode=tp,tp_sp"])
    assert done.exit_code == 0, done.output
    rows = [line.split("│")[1:-1] for line in done.stdout.splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["1", "OK", "tp", "false"],
        ["2", "OK", "tp_sp", "true"],
    ]
