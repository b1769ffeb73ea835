"""The report as Markdown (a README, a PR comment): the same tables, charts as PNG files and diagrams
as SVG files beside it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tpbench.report.blocks import Chart, Diagram, Section


def render(sections: list[Section], out: Path) -> str:
    """The Markdown text; writes each chart as `<out stem>_charts/<name>.png` (a diagram: .svg) next to
    `out`."""
    charts_dir = out.with_name(f"{out.stem}_charts")
    lines: list[str] = []
    for i, s in enumerate(sections):
        lines += [f"{'#' if i == 0 else '##'} {_escape(s.title)}", ""]
        if s.intro:
            lines += [_escape(s.intro), ""]
        if not s.blocks:
            lines += [f"_{_escape(s.empty or 'Nothing to show.')}_", ""]
        for block in s.blocks:
            if isinstance(block, Diagram):
                charts_dir.mkdir(parents=True, exist_ok=True)
                path = charts_dir / f"{block.name}.svg"
                path.write_bytes(block.svg)
                lines += [f"![{_escape(block.title)}]({charts_dir.name}/{path.name})", ""]
                if block.note:
                    lines += [f"_{_escape(block.note)}_", ""]
            elif isinstance(block, Chart):
                charts_dir.mkdir(parents=True, exist_ok=True)
                path = charts_dir / f"{block.name}.png"
                path.write_bytes(block.png)
                lines += [f"![{_escape(block.title)}]({charts_dir.name}/{path.name})", ""]
                if block.note:
                    lines += [f"_{_escape(block.note)}_", ""]
            else:
                lines += [f"### {_escape(block.title)}", "", table(block.display()), ""]
                if block.note:
                    lines += [f"_{_escape(block.note)}_", ""]
    return "\n".join(lines)


def table(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(_escape(str(c)) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join(_escape(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])


def _escape(text: str) -> str:
    """Plain text in a Markdown table cell: no HTML, no column breaks, one line."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return "<br>".join(line for line in text.splitlines()) if "\n" in text else text
