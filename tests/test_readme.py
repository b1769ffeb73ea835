"""The README stays a front page: usage first, results summarized with links into docs/."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).parent.parent / "README.md"
LIMIT = 250


def test_the_readme_is_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= LIMIT, f"README.md is {len(lines)} lines: move detail to docs/ and link it"


def test_usage_comes_before_the_results():
    headings = [line for line in README.read_text().splitlines() if line.startswith("## ")]
    assert headings.index("## Quick start") < headings.index("## Commands") < len(headings) // 2
