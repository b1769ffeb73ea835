"""The documented `run` and `sweep` commands that the tiny model can run, run (test_documented_commands.py
composes every one; this file launches them), and what the docs show them print compared.

Each command runs with the tiny model's sizes put in for larger ones (`TINY`: H 64, L 2, V 256, S 32,
two steps). To pay torchrun's start a few times, not once per command, they run in passes through the
CLI in one folder: the first composes each command's runs (the launch replaced by a list; a sweep cut
to the configs that hold each swept value once, `_cover`), the second runs them all at once
(tpbench.run.sweep.run_each: one torchrun job of warm workers per world size and device), of each
command its first run, or all of them where the page shows what it printed. The third, for those,
runs the command as typed again, its launch giving its runs' outcomes as pass two ended them, so that
it prints what it prints after a real launch.

Left composed only, each for its reason (`not_run`): Slurm (tests/test_slurm.py), faults
(tests/test_runner.py), train.compile (Inductor compiles for about a minute even at this size), a
real GPU, and `--cfg`.

Every run must end OK, but where the page shows it failing (one it shows interrupted by Ctrl-C was
the user's doing). Where the page shows what the command printed, the lines a tiny run reproduces are
compared, with times, run ids, paths and figures masked (`masked`): each run's `run N STATUS: ...`
line and the sweep's table rows.

Beside them, the time model's guard on this CPU (`test_a_tiny_step_s_cpu_time_is_the_predicted_within_3x`).
"""

from __future__ import annotations

import re
import shlex
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_documented_commands import COMMANDS, FENCE, PROMPT, ROOT, Documented, _cover

from tpbench.config import SHORT_NAMES, config_hash

pytestmark = pytest.mark.not_quick

# The tiny model's sizes and two steps, put in where a command asks for more (validate's steps: more
# than 10; a command may plant a bug from its step 5 on, debug.from_step)
TINY = {
    "model.hidden_size": 64,
    "model.num_hidden_layers": 2,
    "model.vocab_size": 256,
    "train.seq_len": 32,
    "train.steps": 2,
    "train.warmup": 1,
    "validate.steps": 2,
    "validate.every": 1,
}
KEPT_UP_TO = {"validate.steps": 10, "validate.every": 10}
WHOLE = 4  # a sweep of more configs than this runs the configs that hold each swept value once


def not_run(doc: Documented) -> str | None:
    """Why a documented command is composed only, or None: it runs here."""
    args = shlex.split(doc.command)[1:]
    settings = dict(a.lstrip("+").split("=", 1) for a in args if "=" in a and not a.startswith("-"))
    if args[0] not in ("run", "sweep") or doc.refusal is not None or "--cfg" in args:
        return "not a launch"
    if len(args) == 1 and doc.where.endswith("span"):
        return "the verb named in a sentence"
    if settings.get("launcher") == "slurm" or "--wait" in args:
        return "Slurm: tests/test_slurm.py"
    if "fault" in settings:
        return "faults: tests/test_runner.py"
    compiled = f"{settings.get('compile', '')},{settings.get('train.compile', '')}".split(",")
    if "true" in compiled:
        return "train.compile: Inductor compiles for about a minute"
    device = settings.get("launch.device", settings.get("device"))
    if device == "cuda" and settings.get("launch.emulate") != "fake":
        return "a real GPU"
    return None


RUNNABLE = [d for d in COMMANDS if not not_run(d)]


def tiny(args: list[str]) -> list[str]:
    """The command's arguments with TINY's values for the sizes it sets larger, TINY's added where
    it sets none."""
    kept = []
    for arg in args:
        key, _, values = arg.partition("=")
        full = SHORT_NAMES.get(key, key)
        most = KEPT_UP_TO.get(full, TINY.get(full))
        if full in TINY and not all(v.isdigit() and int(v) <= most for v in values.split(",")):
            continue
        kept.append(arg)
    given = {SHORT_NAMES.get(a.split("=")[0], a.split("=")[0]) for a in kept if "=" in a}
    return kept + [f"{key}={value}" for key, value in TINY.items() if key not in given]


def shown(doc: Documented) -> list[str]:
    """The lines the page shows the command print: after a `$ tpbench` line, up to the next command
    or the block's end."""
    if doc.where.endswith("span"):
        return []
    page, number = doc.where.split(":")
    lines = (ROOT / page).read_text().splitlines()
    if not lines[int(number) - 1].lstrip().startswith("$ "):
        return []
    said = []
    for line in lines[int(number) :]:
        if FENCE.match(line) or PROMPT.match(line) or line.startswith("$ "):
            break
        said.append(line)
    return said


FIGURE = re.compile(r"-?\d[\d,]*(\.\d+)?(e[-+]?\d+)?")
PATH = re.compile(r"\(logs: [^)]*\)")


def masked(line: str) -> str:
    """A line with its paths and figures (times, run ids, errors) as <path> and <n>, its spaces as
    one (a table's columns are as wide as their figures)."""
    return " ".join(FIGURE.sub("<n>", PATH.sub("(logs: <path>)", line)).split())


RUN_LINE = re.compile(r"run \d+ ([A-Z]+): ")


def compared(lines: list[str], rows: bool = True, runs: bool = True) -> list[str]:
    """The lines a tiny run reproduces, masked: with `runs` each run's `run N STATUS: ...` line but
    OK's and INTERRUPTED's (the user's Ctrl-C), with `rows` the sweep table's rows."""
    kept = []
    for line in lines:
        run = RUN_LINE.match(line)
        if runs and run and run.group(1) not in ("OK", "INTERRUPTED") or rows and line.startswith("│"):
            kept.append(masked(line))
    return kept


def statuses(lines: list[str]) -> list[str]:
    return [m.group(1) for x in lines if (m := RUN_LINE.match(x))]


@dataclass
class Said:
    """What one documented command did in the third pass."""

    exit_code: int | None  # None: not run as typed (its page shows no output)
    stdout: str
    stderr: str
    runs: list = field(default_factory=list)  # its Ran, each as the second pass ended it


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("documented-runs")


@pytest.fixture(scope="module")
def ran(folder: Path, request) -> dict[str, Said]:
    """The runnable documented commands, run in the passes the module docstring says: those whose
    test is selected (`-k`), every one for the time model's guard."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    from tpbench.run import sweep

    monkeypatch = pytest.MonkeyPatch()
    split, run_each = BasicSweeper.split_arguments, sweep.run_each
    try:
        monkeypatch.chdir(folder)
        monkeypatch.setenv("COLUMNS", "200")
        monkeypatch.setattr("tpbench.cli.say_estimates", lambda configs, sweep: [])  # the time model's
        monkeypatch.setattr(sweep, "split_done", lambda configs, dbs, force: (list(configs), []))
        composed = {}
        for doc in selected(request.session.items):
            whole = bool(compared(shown(doc)))  # a page that shows the sweep: all of it
            cut = staticmethod(lambda o, m, whole=whole: [c if whole else _cover(c) for c in split(o, m)])
            monkeypatch.setattr(BasicSweeper, "split_arguments", cut)
            composed[doc.command] = _composed(doc, monkeypatch, whole)
        monkeypatch.setattr(BasicSweeper, "split_arguments", split)
        refused = {command: said for command, said in composed.items() if isinstance(said, str)}
        runs = [c for configs in composed.values() if not isinstance(configs, str) for c in configs]
        outcomes = _run_all(runs, run_each)
        return {
            doc.command: Said(2, "", refused[doc.command])
            if doc.command in refused
            else _replayed(doc, outcomes, monkeypatch)
            if compared(shown(doc))
            else Said(None, "", "", [outcomes[_key(c)][0] for c in composed[doc.command]])
            for doc in selected(request.session.items)
        }
    finally:
        monkeypatch.undo()


def selected(items: list[pytest.Item]) -> list[Documented]:
    names = {item.name for item in items if item.module.__name__ == __name__}
    every = any(name.startswith("test_a_tiny_step") for name in names)
    return [d for d in RUNNABLE if every or f"test_documented_run[{d.command}]" in names]


def _args(doc: Documented) -> list[str]:
    return tiny(shlex.split(doc.command)[1:])


def _composed(doc: Documented, monkeypatch, whole: bool) -> list:
    """Pass 1: the runs the command would launch; of a command whose page shows no output, the first."""
    from tpbench.run import sweep

    asked = []

    def listed(configs, dbs, on_start, say):
        asked.extend(configs)
        return iter(())

    monkeypatch.setattr(sweep, "run_each", listed)
    result = _invoke(_args(doc))
    if not asked:  # refused: its own test fails, saying why
        return f"{' '.join(_args(doc))}: exit {result.exit_code}: {result.stderr}{result.exception!r}"
    return asked if whole else asked[:1]


def _key(cfg) -> tuple:
    return config_hash(cfg), cfg.db.url


def _run_all(configs: list, run_each) -> dict[tuple, tuple]:
    """Pass 2: every command's runs at once, those of one torchrun job together (`run_each`:
    tpbench.run.sweep's): {key: (Ran, said)}."""
    from tpbench.run import batch, sweep

    unique = list({_key(c): c for c in configs}.values())
    unique.sort(key=lambda c: (batch.batch_key(c) is None, str(batch.batch_key(c))))
    dbs = sweep.databases(unique)
    said: list[str] = []
    outcomes = {}
    ran = run_each(unique, dbs, lambda cfg: lambda line: None, said.append)
    for cfg, r in zip(unique, ran, strict=False):  # in order (a run may come back reconfigured: share_dense)
        outcomes[_key(cfg)] = (r, list(said))
        said.clear()
    assert len(outcomes) == len(unique), "interrupted"
    return outcomes


def _replayed(doc: Documented, outcomes: dict, monkeypatch) -> Said:
    """Pass 3, for a command whose page shows its output: the command as typed, its launch giving its
    runs' outcomes from pass 2 and saying what they said."""
    from tpbench.run import sweep

    runs = []

    def replay(configs, dbs, on_start, say):
        for cfg in configs:
            r, lines = outcomes[_key(cfg)]
            for line in lines:
                say(line)
            runs.append(r)
            yield sweep.Ran(r.run_id, cfg, r.status)

    monkeypatch.setattr(sweep, "run_each", replay)
    result = _invoke(_args(doc))
    return Said(result.exit_code, result.stdout, result.stderr, runs)


def _invoke(args: list[str]):
    from typer.testing import CliRunner

    from tpbench.cli import app

    return CliRunner().invoke(app, args, prog_name="tpbench")


def test_the_runnable_commands_are_most_of_the_launches():
    launches = [d for d in COMMANDS if not_run(d) != "not a launch"]
    assert len(RUNNABLE) >= len(launches) * 2 // 3, [(d.command, not_run(d)) for d in launches]
    assert tiny(["layers=8,16", "seq=2048", "layers=1,2"]) == [
        "layers=1,2",
        "model.hidden_size=64",
        "model.vocab_size=256",
        "train.seq_len=32",
        "train.steps=2",
        "train.warmup=1",
        "validate.steps=2",
        "validate.every=1",
    ]
    assert tiny(["validate.steps=6", "validate.every=3"])[:2] == ["validate.steps=6", "validate.every=3"]
    assert "validate.steps=300" not in tiny(["validate.steps=300"])
    assert masked("run 12 FAILED: x 1.14 > bound 1.2e-05 (logs: /tmp/a b)") == (
        "run <n> FAILED: x <n> > bound <n> (logs: <path>)"
    )
    page = ["run 3 OK: memory", "run 4 INTERRUPTED: by SIGINT", "│ 12  │ OK │ tp │", "run 5 FAILED: x 2"]
    assert compared(page) == ["│ <n> │ OK │ tp │", "run <n> FAILED: x <n>"]
    assert compared(page, rows=False) == ["run <n> FAILED: x <n>"]


@pytest.mark.parametrize("doc", RUNNABLE, ids=[d.command for d in RUNNABLE])
def test_documented_run(doc: Documented, ran):
    said, where = ran[doc.command], f"{doc.where}: {doc.command}"
    assert said.exit_code != 2, f"{where}: refused with the tiny sizes: {said.stderr}"
    page = shown(doc)
    expected = [s for s in statuses(page) if s != "INTERRUPTED"] or ["OK"]
    got = sorted({r.status for r in said.runs})
    assert said.runs and got == sorted(set(expected)), f"{where}\n{said.stderr}"
    shown_lines = compared(page)
    if shown_lines:
        assert said.exit_code == (0 if got == ["OK"] else 1), f"{where}\n{said.stderr}"
        rows = any(line.startswith("│") for line in page)
        # the runs' lines as they ended (stderr), then the sweep's table (stdout; a run's own table's
        # title there reads as a run's line too)
        printed = compared(said.stderr.splitlines(), rows=False)
        printed += compared(said.stdout.splitlines(), rows=rows, runs=False)
        assert printed == shown_lines, f"{where} prints otherwise than the page shows:\n{said.stderr}"


# The time model's guard on this CPU: its prediction of a step against the step measured, for every
# throughput run above (the tiny model, T 2 or DP 2). The bound is a factor of 3 either way against the
# step's CPU time on rank 0 (`step_cpu_time_s`): docs/results/time_model.md's grids put the tiny shape at
# -21% to +61% of the wall clock on an idle machine, and its CPU time within the same spread, while the
# suite's own jobs load the two cores beside these runs: a loaded machine stretches the wall clock
# (7-9x at a load of 20 here) but hardly a step's CPU time (0.7-1.4x of the prediction then). A model
# off by 10x either way is outside it. With the rate cache cold (as on CI) the rates are probed during
# the suite, under its load: the collectives' latency, a wall-clock figure, then comes out as the
# loaded machine's, and a T 2 step's prediction matched its wall clock but not its CPU time (CI-like
# run at 7a95e97, every cache cold: predicted 0.0416 s, CPU 0.011-0.013 s, 3.2-3.7x). A step is off
# only where both its CPU time and its wall clock are outside the factor.
FACTOR = 3


def step_times(folder: Path, runs: list) -> dict[int, tuple[float, float, float]]:
    """{run id: (predicted, measured CPU s, measured wall s a step)} of the throughput runs, from
    their database."""
    times = {}
    for r in runs:
        path = folder / r.cfg.db.url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:
            rows = dict(
                db.execute(
                    "SELECT name, value FROM measurements WHERE run_id = ? AND rank = 0 AND name IN "
                    "('predicted_step_time_s', 'step_cpu_time_s', 'step_time_s')",
                    (r.run_id,),
                ).fetchall()
            )
        times[r.run_id] = (rows["predicted_step_time_s"], rows["step_cpu_time_s"], rows["step_time_s"])
    return times


def within(measured: float, predicted: float) -> bool:
    return 1 / FACTOR <= measured / predicted <= FACTOR


def test_a_tiny_step_s_cpu_time_is_the_predicted_within_3x(ran, folder):
    runs = {r.run_id: r for said in ran.values() for r in said.runs if r.cfg.kind == "throughput"}
    assert len(runs) >= 3 and all(r.status == "OK" for r in runs.values())
    times = step_times(folder, list(runs.values()))
    off = {
        f"{runs[i].cfg.parallel.tp}x{runs[i].cfg.parallel.dp} run {i}": (
            f"predicted {p:.4f} s, CPU {c:.4f} s, wall {w:.4f} s"
        )
        for i, (p, c, w) in times.items()
        if not within(c, p) and not within(w, p)
    }
    assert not off, off
