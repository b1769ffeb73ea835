"""The report's content, whatever its format: its sections in order, each built from ReportData by
a module of its own (tpbench.report.blocks has what they are made of)."""

from __future__ import annotations

from tpbench.report.blocks import Section
from tpbench.report.data import ReportData
from tpbench.report.sections import communication, diagrams, header, memory, recompute, throughput, validation

ORDER = (header, memory, recompute, throughput, communication, diagrams, validation)


def build(data: ReportData) -> list[Section]:
    return [part.section(data) for part in ORDER]
