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
