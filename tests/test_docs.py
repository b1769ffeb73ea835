"""The README and docs/ as a reader meets them: every relative link leads somewhere (the file exists,
and an anchor names a heading of its page as GitHub spells the heading's id), every table row has its
header's cells, no words are written twice in a row, each results page names the benchmarks/ script
that made it, and what docs/usage.md says the CLI refuses or accepts is what the CLI does (in process,
nothing launched; the only part that loads torch)."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image outside code."""
    found = []
    for number, line in prose_lines(text):
        line = CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), line)
        targets = [m.group(1) for m in INLINE_LINK.finditer(line)]
        targets += [m.group(1) for m in REFERENCE_LINK.finditer(line)]
        found += [(number, target.strip("<>")) for target in targets]
    return found


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text without markup, lower case, punctuation other than
    hyphens and underscores dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = "".join(c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The ids of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    ids = set()
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        ids.add(base if count == 0 else f"{base}-{count}")
    return ids


def dead_links(page: Path) -> list[str]:
    """'page:line: target (why)' for each relative link of `page` that leads nowhere."""
    text = page.read_text(encoding="utf-8")
    label = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    dead = []
    for number, target in links(text):
        if SCHEME.match(target) or target.startswith("//"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        why = ""
        if not file.exists():
            why = "no such file"
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            why = f"no heading #{anchor} in {file.name}"
        if why:
            dead.append(f"{label}:{number}: {target} ({why})")
    return dead


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dead_relative_link(page: Path) -> None:
    dead = dead_links(page)
    assert not dead, "dead relative links:\n" + "\n".join(dead)


def test_every_docs_page_is_linked_from_the_index() -> None:
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index.read_text())}
    unlinked = [str(p.relative_to(ROOT)) for p in pages()[1:] if p != index and p.resolve() not in linked]
    assert unlinked == []


def test_the_readme_links_the_docs_index() -> None:
    assert "docs/README.md" in [
        target.partition("#")[0] for _, target in links((ROOT / "README.md").read_text())
    ]


def test_a_planted_dead_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# Some page\n\n## Configs (`conf/`)\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](there.md) [ok anchor](there.md#configs-conf) [ok here](#page) [web](https://example.org/x)\n"
        "`[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n"
        "[gone](missing.md) ![gone image](img/none.svg)\n"
        "[bad anchor](there.md#configs) [bad here](#nowhere)\n"
        "[ref]: ../nothing.md\n"
    )
    found = [line.split(": ", 1)[1] for line in dead_links(page)]
    assert found == [
        "missing.md (no such file)",
        "img/none.svg (no such file)",
        "there.md#configs (no heading #configs in there.md)",
        "#nowhere (no heading #nowhere in page.md)",
        "../nothing.md (no such file)",
    ]


def test_slugs_follow_github() -> None:
    assert slug("Configs (`conf/`)") == "configs-conf"
    assert slug("Faults, timeouts, Ctrl-C") == "faults-timeouts-ctrl-c"
    assert (
        slug("Ours vs PyTorch DTensor (T = 2, CPU preset at L 8)")
        == "ours-vs-pytorch-dtensor-t--2-cpu-preset-at-l-8"
    )
    assert slug("Drawing one block (`tpbench diagram`)") == "drawing-one-block-tpbench-diagram"
    assert slug("What is proven where") == "what-is-proven-where"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


# --- Tables: every row has its header's cells --------------------------------------------------------

DELIMITER_ROW = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def cell_count(row: str) -> int:
    """The cells of a table row as GitHub splits it: at each pipe not escaped (`\\|`), a pipe inside a
    code span included; the outer pipes open and close the row."""
    return len(re.split(r"(?<!\\)\|", row.strip().removeprefix("|").removesuffix("|")))


def ragged_rows(text: str) -> list[str]:
    """'line N: k cells, the header m' for each row of a table whose cell count is not its header's
    (a cell too many or too few shifts the rest of the row under the wrong column)."""
    lines = dict(prose_lines(text))
    ragged = []
    for number, line in lines.items():
        below = lines.get(number + 1, "")
        if not (line.lstrip().startswith("|") and DELIMITER_ROW.match(below)):
            continue
        width, row = cell_count(line), number + 1
        while lines.get(row, "").lstrip().startswith("|"):
            if (count := cell_count(lines[row])) != width:
                ragged.append(f"line {row}: {count} cells, the header {width}")
            row += 1
    return ragged


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_row_has_its_headers_cells(page: Path) -> None:
    assert ragged_rows(page.read_text(encoding="utf-8")) == []


def test_a_planted_ragged_row_is_found() -> None:
    text = (
        "| a | b |\n|---|:-:|\n| 1 | `x \\| y` |\n| 2 | 3 | stray |\n| 4 |\n\n"
        "```\n| in | a | fence |\n|---|\n```\n| not | a table |\n"
    )
    assert ragged_rows(text) == ["line 4: 3 cells, the header 2", "line 5: 1 cells, the header 2"]
    assert cell_count("| `a|b` | c |") == 3  # GitHub splits inside a code span too


# --- A run of words written twice in a row -----------------------------------------------------------


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph of prose: not code, tables nor headings."""
    found: list[tuple[int, str]] = []
    start, words = 0, []
    for number, line in [*prose_lines(text), (0, "")]:
        if line.strip() and not line.lstrip().startswith(("|", "#")):
            start, words = start or number, [*words, line.strip()]
        elif words:
            found.append((start, " ".join(words)))
            start, words = 0, []
    return found


def stutters(text: str, shortest: int = 3) -> list[str]:
    """'line N: words' for each run of `shortest` words or more written twice in a row in a paragraph:
    what an edit leaves when it keeps the old line above the new one."""
    found = []
    for start, paragraph in paragraphs(text):
        words = paragraph.split()
        for i, word in enumerate(words):
            for n in range(shortest, (len(words) - i) // 2 + 1):
                if words[i + n] == word and words[i : i + n] == words[i + n : i + 2 * n]:
                    found.append(f"line {start}: {' '.join(words[i : i + n])}")
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_words_written_twice_in_a_row(page: Path) -> None:
    assert stutters(page.read_text(encoding="utf-8")) == []


def test_a_planted_stutter_is_found() -> None:
    text = "# Head\n\nA run's identity is its config\nA run's identity is its config and more.\n\n"
    text += "T 2 + 2 + 2 ranks. | a | a | a |\n"
    assert stutters(text) == ["line 3: A run's identity is its config"]


# --- What docs/usage.md says the CLI refuses, and accepts, checked against the CLI --------------------

USAGE = ROOT / "docs" / "usage.md"


@dataclass(frozen=True)
class Claim:
    said: str  # words of docs/usage.md as written there (a line break read as a space)
    args: str  # the command that shows it; {folder} is the test's folder
    refused: str | None  # the start of the one line it is refused with (exit 2), or None: accepted
    gpus: int = 0  # torch's device count, as on a GPU node (nothing runs on them)


MIXED_OVERLAP = "overlap=true dp=2 recompute=full precision=mixed dtype=bfloat16"
BF16_GEMM = "kind=validate dtype=bfloat16 launch.bf16_gemm=fp32_accumulate"
CLAIMS = [
    Claim("Nothing refuses to run", "run kind=memory dtype=bfloat16 --cfg", None),
    Claim(
        "lr_ahead with a constant lr",
        "run kind=validate debug.optim_fault=lr_ahead --cfg",
        "debug.optim_fault=lr_ahead with a constant lr",
    ),
    Claim(
        "decay_norm without `train.weight_decay` > 0",
        "run kind=validate debug.optim_fault=decay_norm --cfg",
        "debug.optim_fault=decay_norm with train.weight_decay=0",
    ),
    Claim(
        "a mode with a switch it sets otherwise (`mode=tp_sp_vp sp=false`",
        "run mode=tp_sp_vp sp=false --cfg",
        "mode=tp_sp_vp with parallel.sp=false: mode=tp_sp_vp sets parallel.sp=true",
    ),
    Claim("Hydra's own settings (`hydra.run.dir=`", "run hydra.run.dir=x --cfg", "hydra.run.dir=x: Hydra's"),
    Claim("removing a key (`~model.dropout`)", "run ~model.dropout --cfg", "~model.dropout: removes a"),
    Claim("Hydra's `-m`/`--multirun`", "run -m tp=2 --cfg", "tpbench run: No such option: -m; Hydra's"),
    Claim("`layer=4` says `did you mean layers?`", "run layer=4 --cfg", "layer=4: layer is not a tpbench"),
    Claim(
        "`recompute=none|selective|op|full` (every engine: megatron, ddp and dtensor)",
        "run mode=dtensor_tp recompute=op --cfg",
        None,
    ),
    Claim(
        "with `model.dropout > 0` too",
        "run kind=memory tp=2 recompute=op model.dropout=0.1 model.flash_attn=false --cfg",
        None,
    ),
    Claim(
        "Pure fp16 is refused before launch",
        "run dtype=float16 --cfg",
        "train.dtype=float16 with train.precision=pure",
    ),
    Claim(
        "The switch is refused off `dtype=bfloat16`",
        "run kind=validate launch.bf16_gemm=fp32_accumulate --cfg",
        "launch.bf16_gemm=fp32_accumulate with train.dtype=float32",
    ),
    Claim(
        "for any kind but `validate` (it would slow a measured step)",
        f"run {BF16_GEMM} kind=memory --cfg",
        "launch.bf16_gemm=fp32_accumulate with kind=memory",
    ),
    Claim(
        "with `compile=true`, and on CUDA",
        f"run {BF16_GEMM} compile=true --cfg",
        "launch.bf16_gemm=fp32_accumulate with train.compile=true",
    ),
    Claim(
        "with `compile=true`, and on CUDA",
        f"run {BF16_GEMM} launch.device=cuda --cfg",
        "launch.bf16_gemm=fp32_accumulate with launch.device=cuda",
        gpus=8,
    ),
    Claim(
        "Every TP mode and `mode=ddp` take it, in pure and mixed precision, with recompute and overlap",
        f"run kind=validate mode=tp_sp dp_shard=full {MIXED_OVERLAP} --cfg",
        None,
    ),
    Claim(
        "a level with `dp=1` (nothing to shard over)",
        "run dp=1 dp_shard=full --cfg",
        "parallel.dp_shard=full with parallel.dp=1",
    ),
    Claim(
        "`dp_replicate` not dividing dp",
        "run dp=4 dp_shard=full dp_replicate=3 --cfg",
        "parallel.dp_replicate=3 with parallel.dp=4",
    ),
    Claim(
        "or without FSDP2 (`grads`, `full`)",
        "run dp=4 dp_shard=optimizer dp_replicate=2 --cfg",
        "parallel.dp_replicate=2 with dp_shard=optimizer",
    ),
    Claim(
        "`optimizer` on the DTensor engine",
        "run mode=dtensor_tp dp=2 dp_shard=optimizer --cfg",
        "parallel.dp_shard=optimizer with parallel.engine=dtensor",
    ),
    Claim(
        "a debug switch the level cannot take (`debug.ddp_fault`, `debug.skip_grad_sum=dp`",
        "run dp=2 dp_shard=full debug.skip_grad_sum=[dp] --cfg",
        "parallel.dp_shard=full with debug.skip_grad_sum=dp",
    ),
    Claim(
        "[Design: compile](design.md#compile) says what it refuses",
        "run kind=memory launch.emulate=real compile=true --cfg",
        "train.compile=true with launch.emulate=real",
    ),
    Claim(
        "Overlap is modelled in `kind=memory` and `tpbench plan` in pure and mixed precision, under every "
        "recompute setting, at DP 1 and 2 alike",
        f"run kind=memory {MIXED_OVERLAP} --cfg",
        None,
    ),
    Claim(
        "Overlap is modelled in `kind=memory` and `tpbench plan` in pure and mixed precision",
        f"plan {MIXED_OVERLAP}",
        None,
    ),
    Claim(
        "or PostgreSQL database that is not a tpbench database, is refused with one line and left untouched",
        "runs --db sqlite:///{folder}/other.db",
        "sqlite:///{folder}/other.db is not a tpbench database (its tables: other); left untouched",
    ),
    Claim(
        "or that contradicts `--format`, is refused in one line, as in `tpbench diagram`",
        "report --out rep.md --format html --db sqlite:///{folder}/none.db",
        "--out rep.md with --format html: the extension says md",
    ),
    Claim(
        "or that contradicts `--format`, is refused in one line, as in `tpbench diagram`",
        "diagram tp=2 --format png --out b.svg",
        "--out b.svg with --format png: the extension says svg",
    ),
]


def _usage_text() -> str:
    return " ".join(USAGE.read_text(encoding="utf-8").split())


def _invoke(*args: str):
    from typer.testing import CliRunner

    from tpbench.cli import app

    return CliRunner().invoke(app, list(args), prog_name="tpbench")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    import sqlite3

    path = tmp_path_factory.mktemp("claims")
    with sqlite3.connect(path / "other.db") as other:
        other.execute("CREATE TABLE other (x)")
    return path


@pytest.mark.parametrize(
    "claim",  # a plan predicts the step's time too: seconds, in the whole suite only
    [pytest.param(c, marks=[pytest.mark.not_quick] if c.args.startswith("plan") else []) for c in CLAIMS],
    ids=[c.args for c in CLAIMS],
)
def test_usage_says_what_the_cli_does(claim: Claim, folder: Path, monkeypatch) -> None:
    import shlex

    assert claim.said in _usage_text(), f"docs/usage.md no longer says: {claim.said}"
    monkeypatch.chdir(folder)
    if claim.gpus:
        import torch

        monkeypatch.setattr(torch.cuda, "device_count", lambda: claim.gpus)
    before = (folder / "other.db").read_bytes()
    result = _invoke(*shlex.split(claim.args.format(folder=folder)))
    if claim.refused is None:
        assert result.exit_code == 0, f"{claim.args}: {result.stderr}{result.exception!r}"
    else:
        lines = result.stderr.splitlines()
        assert (result.exit_code, len(lines)) == (2, 1), f"{claim.args}: {result.stderr}"
        assert lines[0].startswith(claim.refused.format(folder=folder)), lines[0]
    assert (folder / "other.db").read_bytes() == before  # a database refused is left untouched


def test_each_refusal_usage_states_is_checked() -> None:
    """Each paragraph of docs/usage.md that says something is refused (or is not) holds a claim of
    CLAIMS, checked above against the CLI; a refusal written without one fails here."""
    claimed = [claim.said for claim in CLAIMS]
    unchecked = [
        f"docs/usage.md:{line}: {text[:100]}"
        for line, text in paragraphs(USAGE.read_text(encoding="utf-8"))
        if re.search(r"refus", text, re.I) and not any(said in text for said in claimed)
    ]
    assert unchecked == []


def test_json_stderr_is_what_usage_says(tmp_path: Path, monkeypatch) -> None:
    """`--json`: stdout the JSON objects alone; each line stderr keeps is one that usage.md's `--json`
    paragraph names (where the runs go, a run that did not end OK)."""
    import json

    from test_db import outcome

    from tpbench.results import Status
    from tpbench.run import sweep

    statuses = iter([Status.OK, Status.FAILED])
    monkeypatch.setattr(
        sweep, "_outcomes", lambda group, on_start: [(c, outcome(next(statuses))) for c in group]
    )
    url = f"sqlite:///{tmp_path / 'j.db'}"
    result = _invoke("sweep", "kind=validate", "mode=tp,tp_sp", "--json", "--db", url)
    assert result.exit_code == 1, result.stderr
    assert [json.loads(line)["status"] for line in result.stdout.splitlines()] == ["OK", "FAILED"]
    said = next(text for _, text in paragraphs(USAGE.read_text()) if text.startswith("Under `--json`"))
    named = {
        "recording in ": "`recording in URL`",
        "run 2 FAILED: ": "a line for each run that did not end OK",
    }
    lines = result.stderr.splitlines()
    assert [line.startswith(tuple(named)) for line in lines] == [True, True], lines
    assert all(words in said for words in named.values()), said


# --- Each results page names what made it; each benchmark makes a page --------------------------------

RESULTS = sorted((ROOT / "docs" / "results").glob("*.md"))
SCRIPT_PATH = re.compile(r"(?<![\w/.-])(?:scripts|benchmarks)/[\w.-]+\.(?:py|sh)\b")


def made_by(text: str, within: int = 20) -> str | None:
    """The paragraph starting `Made by:` in a page's first `within` lines, or None."""
    return next((p for line, p in paragraphs(text) if p.startswith("Made by:") and line <= within), None)


def benchmarks(root: Path = ROOT) -> list[str]:
    return sorted(
        f"benchmarks/{p.name}" for p in (root / "benchmarks").iterdir() if p.suffix in (".py", ".sh")
    )


@pytest.mark.parametrize("page", RESULTS, ids=lambda p: p.name)
def test_each_results_page_names_what_made_it(page: Path) -> None:
    said = made_by(page.read_text(encoding="utf-8"))
    assert said, f"{page.name}: no `Made by:` paragraph in its first 20 lines"
    named = SCRIPT_PATH.findall(said)
    assert named or "(no script)" in said, said  # a page of `tpbench` commands alone says so
    assert [n for n in named if not (ROOT / n).is_file()] == []


def test_each_benchmark_is_named_by_a_results_page() -> None:
    named = {n for page in RESULTS for n in SCRIPT_PATH.findall(made_by(page.read_text()) or "")}
    assert [b for b in benchmarks() if b not in named] == []


def test_every_script_the_project_names_exists() -> None:
    """A script moved or renamed leaves no reference behind: in the docs, the tests, the package,
    the scripts themselves and CI."""
    files = [ROOT / "README.md", ROOT / ".ci" / "run", *(ROOT / "docs").rglob("*.md")]
    for folder, pattern in (("tests", "*.py"), ("tpbench", "*.py"), ("scripts", "*"), ("benchmarks", "*")):
        files += (ROOT / folder).rglob(pattern)
    missing = [
        f"{file.relative_to(ROOT)}: {name}"
        for file in files
        if file.is_file() and file.suffix not in (".pyc", ".db")
        for name in SCRIPT_PATH.findall(file.read_text(encoding="utf-8", errors="replace"))
        if not (ROOT / name).is_file()
    ]
    assert missing == []


@pytest.mark.parametrize("folder", ["scripts", "benchmarks"])
def test_each_script_is_in_its_folders_readme(folder: str) -> None:
    """scripts/README.md and benchmarks/README.md, what a newcomer opens first, list every script."""
    readme = (ROOT / folder / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / folder).iterdir() if p.suffix in (".py", ".sh"))
    assert [s for s in scripts if f"`{s}`" not in readme] == []
    assert dead_links(ROOT / folder / "README.md") == []
