"""Every relative link of the README and of docs/ leads somewhere: the file exists, and an anchor
names a heading of its page as GitHub spells the heading's id. No torch: plain text only."""

from __future__ import annotations

import re
import unicodedata
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
