"""The blocks a report is made of, whatever its format: sections of tables, charts and diagrams.

A `Table` keeps raw values and one formatter per column (units come from tpbench.report.units), so
HTML (pandas Styler) and Markdown show the same text. Charts are PNG bytes (tpbench.report.charts).
A section with nothing to show says so in one line instead (`kind_empty`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from tpbench.report import units
from tpbench.report.data import ReportData
from tpbench.report.labels import mode_rank

Formatter = Callable[[object], str]


@dataclass
class Table:
    title: str
    frame: pd.DataFrame  # raw values; the column names are what the reader sees
    formats: dict[str, Formatter] = field(default_factory=dict)
    note: str = ""
    verdict: str | None = None  # a column of passed / FAILED, coloured in HTML

    def display(self) -> pd.DataFrame:
        """Every cell as the text the reader sees."""
        return pd.DataFrame(
            {col: self.frame[col].map(self.formats.get(col, units.text)) for col in self.frame.columns},
            index=self.frame.index,
        )


@dataclass
class Chart:
    title: str
    png: bytes
    name: str  # file stem when written beside a Markdown report
    note: str = ""


@dataclass
class Diagram:
    """One block of a mode, drawn by `tpbench diagram` (an SVG file's bytes)."""

    title: str
    svg: bytes
    name: str  # file stem when written beside a Markdown report
    note: str = ""


@dataclass
class Section:
    id: str
    title: str
    intro: str = ""
    blocks: list[Table | Chart | Diagram] = field(default_factory=list)
    empty: str = ""  # shown instead of the blocks when there are none


def kind_empty(data: ReportData, kind: str) -> str:
    failed = int((data.failed["kind"] == kind).sum())
    tail = f" ({failed} failed: see the header)" if failed else ""
    return f"No OK {kind} runs in this selection{tail}."


def pick(title: str, frame: pd.DataFrame, columns: dict[str, tuple[str, Formatter | None]]) -> Table:
    """A table of the columns the frame has: {label: (column, formatter)}."""
    present = {label: (col, fmt) for label, (col, fmt) in columns.items() if col in frame}
    table = pd.DataFrame({label: frame[col].to_numpy() for label, (col, _) in present.items()})
    formats = {label: fmt for label, (_, fmt) in present.items() if fmt is not None}
    return Table(title, table, formats)


def integer(value: object) -> str:
    return units.DASH if value is None or pd.isna(value) else f"{int(value)}"


def timed_by(value: object) -> str:
    """The metric timing_cuda_events: how a throughput run took its times (tpbench.parallel.timing)."""
    return units.DASH if value is None or pd.isna(value) else "CUDA events" if value else "wall clock"


def yes_no(value: object) -> str:
    """A 0/1 metric (host_bound) as yes or no."""
    return units.DASH if value is None or pd.isna(value) else "yes" if value else "no"


def mode_key(label: str) -> tuple[int, str]:
    """A run's label (its mode, then its DP level: tp_sp FSDP) in mode order."""
    return mode_rank(label.split(" ")[0]), label
