"""Every `tpbench` command that README.md and docs/ quote runs, so that a documented command cannot
break unseen: the commands are read from the markdown here, a new one is covered by being written.

In one process (typer's CliRunner), in an empty folder, as on a node with 8 GPUs (torch's device
count; nothing runs on them):
- `run` and `sweep` are composed and checked (`--cfg`), not launched; one that the docs show refused
  after composing (db.url) runs up to the launch, which is replaced by a stand-in (`Launched`);
- `plan`, `fit`, `diagram`, `runs`, `report` run as typed, cut down where slow: a sweep keeps the
  configs that together hold each swept value once (`_cover`), `--measure` emulates 2 layers;
- a command the docs show refused (`$ tpbench ...` followed by its one line) must print that line
  and exit 2, or 1 where the line is fit's answer that nothing fits (`refused_with`); any other must
  exit 0. A bare `tpbench VERB` in a sentence names the verb: its --help.
Placeholders are filled: shell variables from the block's assignments (`C="..."`, `for seed in 0`),
`recompute=R` and `=T` with a value, a PostgreSQL URL with the folder's SQLite file,
`path/to/config.json` with a small Llama config.json.

Golden outputs: what each documented `plan` and `fit` prints (as run here, cut down as above) is kept
in tests/golden/ and compared line for line, so that a change to a figure or a label is a diff in
review, never silence. Where a plan predicts a step on this CPU, the CPU is a stand-in with fixed rates
(`STAND_IN_CPU`: 2 cores, its probes' figures set here), so the files hold on any machine. After a
change that moves them on purpose, write them anew and review the diff:

    TPBENCH_UPDATE_GOLDEN=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_documented_commands.py
    git diff tests/golden/
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
GOLDEN_VERBS = ("plan", "fit")
WALL_CLOCK = re.compile(r"(tensors, )[\d.]+ s\)")  # "emulated rank 0 (fake tensors, 0.8 s)", wrapped or not
# The stand-in CPU of the golden outputs: what rate_probe would have probed, fixed (figures of the same
# order as a 2-core server's: fp32 GEMMs 100 GFLOP/s, bf16 20x slower, memory 20 GB/s, 8 us an op)
STAND_IN_CPU = {
    "cores": 2,
    "flops_per_s": {"float32": 100e9, "float64": 50e9, "bfloat16": 5e9, "float16": 5e9},
    "rates": {
        "gemm_small": 80e9,
        "attention": 60e9,
        "bandwidth": 20e9,
        "cache_bandwidth": 30e9,
        "op_s": 8e-6,
        **{f"alpha_{k}": 1e-3 for k in ("all_reduce", "all_gather", "reduce_scatter")},
        **{f"beta_{k}": 1e-9 for k in ("all_reduce", "all_gather", "reduce_scatter")},
    },
    "fp32_accumulate_op_s": 2e-6,
}
PROMPT = re.compile(r"^\s*(\$ )?tpbench\s(?!\w+: )")  # not `tpbench run: No such option ...`
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`(tpbench [^`]*)`")
ASSIGNMENT = re.compile(r"""^\s*(\w+)=["']([^"']*)["']""")
FOR_LOOP = re.compile(r"\bfor (\w+) in (\S+)")
UNPARSED = {"order": "false,true"}  # order=$( ... ): a shell expression that picks one of the two
FILLED = [
    (re.compile(r"postgresql://\S+"), "sqlite:///runs/tpbench.db"),
    (re.compile(r"\brecompute=R\b"), "recompute=full"),
    (re.compile(r"=T\b"), "=2"),
    (re.compile(r"\[(--\w+ \w+)\]"), r"\1"),  # an optional option, shown in brackets
]


@dataclass(frozen=True)
class Documented:
    where: str  # page:line
    command: str
    refusal: str | None  # the one line the docs show it refused with


def documented(root: Path = ROOT) -> list[Documented]:
    """Every `tpbench` command of the README and docs/: each line of a fenced block that starts with
    `tpbench` or `$ tpbench` (a trailing backslash joins the next line), and each code span."""
    found: dict[str, Documented] = {}
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        lines = page.read_text().splitlines()
        variables = _variables(lines)
        fenced = False
        for number, line in enumerate(lines, 1):
            where = f"{page.relative_to(root)}:{number}"
            if FENCE.match(line):
                fenced = not fenced
            elif fenced and PROMPT.match(line):
                command, refusal = _joined(lines, number - 1), _refusal(lines, number - 1)
                _add(found, where, command, refusal, variables)
            elif not fenced:
                for span in CODE_SPAN.findall(line):
                    _add(found, f"{where} span", span, None, variables)
    return list(found.values())


def _variables(lines: list[str]) -> dict[str, str]:
    variables = dict(UNPARSED)
    for line in lines:
        variables.update({m.group(1): m.group(2) for m in [ASSIGNMENT.match(line)] if m})
        variables.update({name: value for name, value in FOR_LOOP.findall(line)})
    return variables


def _joined(lines: list[str], i: int) -> str:
    command = lines[i]
    while command.rstrip().endswith("\\") and i + 1 < len(lines):
        i += 1
        command = command.rstrip()[:-1].rstrip() + " " + lines[i].strip()
    return command


def _refusal(lines: list[str], i: int) -> str | None:
    """`$ tpbench ...` then one line, then the block's end or the next `$`: the refusal shown."""
    if not lines[i].lstrip().startswith("$ ") or i + 2 >= len(lines):
        return None
    after = lines[i + 2]
    if lines[i + 1].startswith("$ ") or not (after.startswith("$ ") or FENCE.match(after)):
        return None
    said = lines[i + 1]  # not a run's own line, nor the path a command wrote
    return None if re.match(r"(run|sweep) \d+ ", said) or " " not in said.strip() else said


def _add(found: dict, where: str, text: str, refusal: str | None, variables: dict[str, str]) -> None:
    text = text.strip().removeprefix("$ ")
    text = re.split(r"\s+#|;|\s2?>|\s&$", text)[0].strip()  # a comment, a second command, a redirect
    if "..." in text:  # `tpbench run ...`: any overrides
        return
    for name, value in variables.items():
        text = re.sub(rf"\${name}\b", value, text)
    for pattern, value in FILLED:
        text = pattern.sub(value, text)
    found.setdefault(text, Documented(where, text, refusal))


def _cover(combos: list[list[str]]) -> list[list[str]]:
    """The combos of a sweep that together hold every swept value, the first of each: a sweep of
    layers=8,16,32,64 x 5 modes composes 5 configs, not 20."""
    seen: set[str] = set()
    kept = [c for c in combos if not set(c) <= seen and not seen.update(c)]
    return kept or combos[:1]


class Launched(Exception):
    """Raised where a run would start torchrun or submit to Slurm."""


COMMANDS = documented()


def composes_many(doc: Documented) -> bool:
    """A `sweep` or `plan` of a preset or of 8 configs or more: seconds of Hydra composing (one
    compose is about 0.1 s idle), run in the whole suite, left out of the quick tier (`not_quick`)."""
    verb, *args = shlex.split(doc.command)[1:]
    swept = [len(a.split("=", 1)[1].split(",")) for a in args if "=" in a and not a.startswith("-")]
    preset = any(a.startswith("+preset=") for a in args)
    return verb in ("sweep", "plan") and (preset or math.prod(swept) >= 8)


def test_the_docs_quote_commands_of_every_verb():
    verbs = {shlex.split(d.command)[1] for d in COMMANDS}
    assert verbs >= {"run", "sweep", "runs", "report", "plan", "fit", "diagram"}
    assert sum(d.refusal is not None for d in COMMANDS) >= 10


def test_placeholders_are_filled_and_refusals_read():
    page = [
        "```",
        'C="model=minimind layers=4"',
        "for seed in 3 4; do",
        "  tpbench sweep train.seed=$seed $C recompute=R \\",
        "      tp=T   # a comment",
        "$ tpbench run tp=0",
        "parallel.tp=0: accepted are integers >= 1",
        "$ tpbench run kind=validate",
        "run 1 FAILED: validate out of bounds",
        "```",
        "and `tpbench run ...` with `tpbench runs --db postgresql://u:$PW@h/db`",
    ]
    found = {}
    variables = _variables(page)
    for i, line in enumerate(page):
        if PROMPT.match(line):
            _add(found, str(i), _joined(page, i), _refusal(page, i), variables)
    for span in CODE_SPAN.findall(page[-1]):
        _add(found, "span", span, None, variables)
    assert [(d.command, d.refusal) for d in found.values()] == [
        ("tpbench sweep train.seed=3 model=minimind layers=4 recompute=full tp=2", None),
        ("tpbench run tp=0", "parallel.tp=0: accepted are integers >= 1"),
        ("tpbench run kind=validate", None),
        ("tpbench runs --db sqlite:///runs/tpbench.db", None),
    ]
    assert _cover([["a=1", "b=1"], ["a=2", "b=1"], ["a=1", "b=2"], ["a=2", "b=2"]]) == [
        ["a=1", "b=1"],
        ["a=2", "b=1"],
        ["a=1", "b=2"],
    ]


def test_a_preset_or_a_sweep_of_eight_configs_leaves_the_quick_tier(request):
    assert composes_many(Documented("", "tpbench sweep +preset=seed_check", None))
    assert composes_many(Documented("", "tpbench plan tp=1,2 dp_shard=none,optimizer,grads,full", None))
    assert not composes_many(Documented("", "tpbench sweep mode=tp,tp_sp kind=validate,memory", None))
    assert not composes_many(Documented("", "tpbench fit +preset=seed_check", None))
    assert request.node.get_closest_marker("quick")  # conftest.py marks the others quick
    slow = [d.command for d in COMMANDS if composes_many(d)]
    assert "tpbench sweep +preset=seed_tp_memory_cpu" in slow and len(slow) < len(COMMANDS) / 3
    from conftest import quick

    class Case:  # a test_documented_command item as conftest.py's `quick` reads it
        nodeid, fixturenames = "tests/test_documented_commands.py::test_documented_command[x]", ["folder"]

        def __init__(self, marked: bool) -> None:
            self.marked = marked

        def get_closest_marker(self, name: str) -> bool:
            return self.marked and name == "not_quick"

    assert quick(Case(marked=False)) and not quick(Case(marked=True))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("documented")
    llama = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
    llama |= {"num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024}
    (path / "config.json").write_text(json.dumps(llama))
    from tpbench.db import ResultsDB

    ResultsDB(f"sqlite:///{path}/runs/tpbench.db")  # what the docs' `report` reads: a database, no runs yet
    return path


@pytest.mark.parametrize(
    "doc",
    [pytest.param(d, marks=[pytest.mark.not_quick] if composes_many(d) else []) for d in COMMANDS],
    ids=[d.command for d in COMMANDS],
)
def test_documented_command(doc: Documented, folder: Path, monkeypatch):
    args = shlex.split(doc.command.replace("path/to/config.json", str(folder / "config.json")))[1:]
    missing = missing_part(args)
    if missing:  # before torch and Hydra load: the CI test below runs these skips in a pytest of its own
        pytest.skip(missing)  # under CI, which installs every part, a failure (ci_skips.py)
    import torch

    from tpbench.run import compose, slurm, sweep

    monkeypatch.chdir(folder)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # launch.device=cuda: as on a GPU node
    golden = args[0] in GOLDEN_VERBS and doc.refusal is None
    if not golden:  # a golden output is the command's whole, every config of its sweep
        # The class compose.expand calls: Hydra's plugin scan imports its module again in this process
        # (another BasicSweeper), so patching a freshly imported one took or not by the tests' order
        # (a plan's golden held 8 configs after the others, 5 alone)
        sweeper = compose.BasicSweeper
        split = sweeper.split_arguments
        monkeypatch.setattr(
            sweeper, "split_arguments", staticmethod(lambda o, m: [_cover(c) for c in split(o, m)])
        )
    for module, name in ((sweep, "run_each"), (slurm, "submit_and_follow")):
        monkeypatch.setattr(module, name, lambda *a, **k: (_ for _ in ()).throw(Launched()))
    if len(args) == 1 and doc.where.endswith("span"):  # `tpbench fit` in a sentence names the verb
        args.append("--help")
    if "--measure" in args:  # the emulation's cost is per layer
        args = [a for a in args if not a.startswith("layers=")] + ["layers=2"]
    if "--out" in args and not doc.refusal:
        i = args.index("--out") + 1
        args[i] = str(folder / Path(args[i]).name)
    composed = args[0] in ("run", "sweep") and "--cfg" not in args  # composed, checked, not run
    if golden:
        stand_in_cpu(monkeypatch)
    result = _invoke([*args, "--cfg"] if composed else args)
    where = f"{doc.where}: {doc.command}"
    if doc.refusal is not None and composed and result.exit_code == 0:  # refused past --cfg
        result = _invoke(args)
    if doc.refusal is not None:
        assert (result.exit_code, result.stderr.strip()) == (refused_with(doc), doc.refusal), where
    elif not isinstance(result.exception, Launched):
        expected = 1 if answered(doc, result.stderr) else 0  # fit's tables, then its nothing-fits line
        assert result.exit_code == expected, f"{where}\n{result.stderr}{result.exception!r}"
    if golden:
        same_as_golden(doc, args, result, folder)


def missing_part(args: list[str]) -> str | None:
    """Why this machine cannot run a documented command as documented, or None: `launcher=slurm`
    submits only where sbatch and submitit are (tpbench.run.slurm.check_slurm refuses it otherwise)."""
    if "launcher=slurm" not in args:
        return None
    if shutil.which("sbatch") is None:
        return "launcher=slurm: no sbatch on PATH (Slurm is not installed): `bash scripts/setup.sh --tests`"
    if importlib.util.find_spec("submitit") is None:
        return "launcher=slurm: submitit is not installed: `pip install -e '.[test]'` installs it"
    return None


SLURM_COMMANDS = [d for d in COMMANDS if "launcher=slurm" in d.command.split()]


def test_without_sbatch_a_documented_slurm_command_skips(folder, monkeypatch):
    """Where Slurm is not installed, each `launcher=slurm` command skips with the reason, as the
    Slurm tests do (conftest.py `slurm`), instead of failing on check_slurm's refusal."""
    assert len(SLURM_COMMANDS) >= 4
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "sbatch" else which(name))
    for doc in SLURM_COMMANDS:
        with pytest.raises(pytest.skip.Exception, match="no sbatch on PATH"):
            test_documented_command(doc, folder, monkeypatch)


@pytest.mark.not_quick
def test_under_ci_a_documented_slurm_command_without_sbatch_fails(tmp_path):
    """CI installs Slurm: there the same skip fails the test (ci_skips.py), a pytest of its own with
    no sbatch on PATH and CI=true."""
    env = dict(os.environ, CI="true", PATH=str(Path(sys.executable).parent), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
         *(f"{__file__}::test_documented_command[{d.command}]" for d in SLURM_COMMANDS)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == len(SLURM_COMMANDS), done.stdout[-3000:]
    assert all("skipped under CI" in line and "no sbatch on PATH" in line for line in failed), failed


def stand_in_cpu(monkeypatch) -> None:
    """The CPU a golden output's plan predicts for: STAND_IN_CPU's rates, named, on its cores."""
    from tpbench import machine
    from tpbench.predict import rate_probe

    cpu = STAND_IN_CPU
    monkeypatch.setattr(rate_probe, "time_rates", lambda cfg, threads, group: dict(cpu["rates"]))
    monkeypatch.setattr(rate_probe, "rate", lambda dtype, cfg, threads: cpu["flops_per_s"][dtype])
    monkeypatch.setattr(rate_probe, "fp32_accumulate_op_s", lambda cfg, threads: cpu["fp32_accumulate_op_s"])
    monkeypatch.setattr(machine, "cpu_name", lambda: "a stand-in CPU")
    monkeypatch.setattr(os, "cpu_count", lambda: cpu["cores"])
    monkeypatch.setenv("COLUMNS", "160")


def golden_file(command: str) -> Path:
    """tests/golden/<the command's words>-<a hash of the whole>.txt"""
    words = re.sub(r"[^\w.=,+-]+", "_", command.removeprefix("tpbench ")).strip("_")[:90]
    return GOLDEN / f"{words}-{hashlib.sha1(command.encode()).hexdigest()[:8]}.txt"


def golden_text(doc: Documented, args: list[str], result, folder: Path) -> str:
    said = f"$ tpbench {shlex.join(args)}\n# exit {result.exit_code}\n{result.stdout}"
    if result.stderr:
        said += f"# stderr\n{result.stderr}"
    said = said.replace(str(folder), "<folder>")
    return WALL_CLOCK.sub(r"\1<wall> s)", said)  # --measure's own time: no figure of the model's


def same_as_golden(doc: Documented, args: list[str], result, folder: Path) -> None:
    path, text = golden_file(doc.command), golden_text(doc, args, result, folder)
    if os.environ.get("TPBENCH_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), (
        f"no golden output for {doc.where}: {doc.command} (TPBENCH_UPDATE_GOLDEN=1 writes it)"
    )
    kept = path.read_text()
    diff = "\n".join(
        difflib.unified_diff(kept.splitlines(), text.splitlines(), str(path), "now", lineterm="")
    )
    assert kept == text, f"{doc.where}: {doc.command} prints otherwise than {path.name}:\n{diff}"


def test_every_golden_output_belongs_to_a_documented_command():
    kept = {golden_file(d.command).name for d in COMMANDS if shlex.split(d.command)[1] in GOLDEN_VERBS}
    stale = sorted(p.name for p in GOLDEN.glob("*.txt") if p.name not in kept)
    assert not stale, f"golden outputs of no documented command (remove them): {stale}"


def refused_with(doc: Documented) -> int:
    """The exit code of a documented one-line answer: 1 for fit's nothing-fits line (an answer, not bad
    input), 2 for a refusal."""
    from tpbench.sizing.search import FITS_NO_LAYOUT

    return 1 if doc.command.split()[1] == "fit" and FITS_NO_LAYOUT in doc.refusal else 2


def answered(doc: Documented, stderr: str) -> bool:
    """fit's nothing-fits line (exit 1) after its tight table, where the page quotes that line whole."""
    from tpbench.sizing.search import FITS_NO_LAYOUT

    line, page = stderr.strip(), (ROOT / doc.where.split(":")[0]).read_text()
    return doc.command.split()[1] == "fit" and FITS_NO_LAYOUT in line and line in page.splitlines()


def _invoke(args: list[str]):
    from typer.testing import CliRunner

    from tpbench.cli import app

    return CliRunner().invoke(app, args, prog_name="tpbench")
