"""`tpbench report`: DDP vs TP vs SP vs VP as tables and charts, from the results database.

    selection = Selection.parse(kind="memory", where=["layers=8"])
    path = write(ResultsDB(url, create=False), selection, "html", None)

html: one self-contained file; md: the same tables with the charts as PNG files beside it;
csv / json: the raw rows (every selected run joined with its headline metrics).
data.py selects and shapes (labels.py: what it calls a run, its mode and DP level), sections/ decides
what is shown, charts.py draws, html.py and markdown.py render.
"""

from __future__ import annotations

from pathlib import Path

from tpbench.db import ResultsDB
from tpbench.report.data import ReportData, Selection, SelectionError, load, raw_rows

FORMATS = ("html", "md", "csv", "json")
DEFAULT_DIR = Path("runs")


class NothingToReport(Exception):
    """The selection holds no run; nothing is written."""


def default_path(fmt: str) -> Path:
    return DEFAULT_DIR / f"report.{fmt}"


def write(db: ResultsDB, selection: Selection, fmt: str, out: Path | None = None) -> Path:
    """Render the selected runs as `fmt` into `out` (default runs/report.<fmt>); returns the path.

    Raises SelectionError for a bad format or filter, NothingToReport for an empty selection."""
    if fmt not in FORMATS:
        raise SelectionError(f"--format {fmt}: accepted are {', '.join(FORMATS)}")
    data = load(db, selection)
    if data.runs.empty:
        raise NothingToReport(f"no runs match {selection.describe()} in {data.db_url}: nothing to report")
    out = Path(out) if out is not None else default_path(fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data, fmt, out), encoding="utf-8")
    return out


def render(data: ReportData, fmt: str, out: Path) -> str:
    if fmt == "csv":
        return raw_rows(data).to_csv(index=False)
    if fmt == "json":
        return raw_rows(data).to_json(orient="records", date_format="iso", indent=1) + "\n"
    from tpbench.report import sections  # matplotlib and seaborn load only for the rendered formats

    built = sections.build(data)
    if fmt == "md":
        from tpbench.report import markdown

        return markdown.render(built, out)
    from tpbench.report import html

    return html.render(built)


__all__ = ["FORMATS", "NothingToReport", "Selection", "SelectionError", "default_path", "write"]
