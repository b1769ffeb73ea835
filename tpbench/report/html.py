"""The report as one self-contained HTML file: inline CSS, charts as PNG data URIs, diagrams as inline
SVG, no script.

Every string that comes from a config, a sweep name or an error message is escaped: the template
autoescapes, and tables go through pandas' Styler with escape="html".
"""

from __future__ import annotations

import base64
from itertools import count
from pathlib import Path

import pandas as pd
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from tpbench.diagram import inline_svg
from tpbench.report.blocks import Section, Table

TEMPLATES = Path(__file__).with_name("templates")
FAILED_STYLE = "color: #b42318; font-weight: bold"
PASSED_STYLE = "color: #067647"


def render(sections: list[Section]) -> str:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["j2"]))
    ids = count()
    env.filters["b64"] = lambda data: base64.b64encode(data).decode("ascii")
    env.filters["styled"] = lambda table: Markup(styled(table, f"t{next(ids)}"))
    env.filters["inline_svg"] = lambda svg: Markup(inline_svg(svg))  # Graphviz escapes its text
    return env.get_template("report.html.j2").render(title=sections[0].title, sections=sections)


def styled(table: Table, uuid: str) -> str:
    """A table as HTML through pandas' Styler: escaped cells, text left and numbers right."""
    shown = table.display()
    text_columns = [c for c in shown.columns if c not in table.formats]
    classes = pd.DataFrame("", index=shown.index, columns=shown.columns)
    classes[text_columns] = "text"
    styler = (
        shown.style.format(escape="html")
        .format_index(escape="html", axis=1)
        .hide(axis="index")
        .set_td_classes(classes)
        .set_uuid(uuid)
    )
    if table.verdict in shown:
        styler = styler.map(
            lambda v: FAILED_STYLE if v == "FAILED" else PASSED_STYLE if v == "passed" else "",
            subset=[table.verdict],
        )
    return styler.to_html()
