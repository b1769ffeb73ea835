"""`tpbench diagram`: one transformer block at TP = T, drawn from a traced training step.

    traces = [trace(c) for c in configs(["tp=4", "sp=true"], compare=True)]   # TP, TP+SP
    svg = render(traces, "svg")

trace.py runs the step on emulated ranks and records it; draw.py lays the record out with Graphviz.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from pathlib import Path

from tpbench.config import ConfigError, RunConfig
from tpbench.diagram.draw import draw
from tpbench.diagram.trace import Trace, trace
from tpbench.parallel.checks import check_shardable

FORMATS = ("svg", "png")
DEFAULT_DIR = Path("runs")


def configs(overrides: Sequence[str], compare: bool = False) -> list[RunConfig]:
    """The checked config to trace (one layer, dp = 1); with `compare`, the same without and with SP.
    Raises ConfigError, one line, for anything that cannot be traced."""
    from tpbench.run import compose  # hydra and the experiments load only here

    cfg = traceable(compose.expand([*overrides, "kind=validate"], single=True)[0])
    if not compare:
        return [cfg]
    out = []
    for sp in (False, True):
        c = copy.deepcopy(cfg)
        c.parallel.sp = sp
        check_shardable(c)
        out.append(c)
    return out


def traceable(cfg: RunConfig) -> RunConfig:
    """A copy of a checked config with one layer (one block is the picture). Raises ConfigError."""
    p = cfg.parallel
    if p.engine != "megatron":
        raise ConfigError(
            f"parallel.engine={p.engine}: the diagram traces tpbench's own collectives; accepted are "
            f"mode=tp, tp_sp, tp_vp, tp_sp_vp"
        )
    if p.dp != 1:
        raise ConfigError(f"parallel.dp={p.dp}: the diagram draws one TP group; accepted is dp=1")
    cfg = copy.deepcopy(cfg)
    cfg.model.num_hidden_layers = 1
    cfg.train.compile = False  # the trace steps the block eager on emulated ranks (compile=auto on CUDA)
    return cfg


def render(traces: list[Trace], fmt: str) -> bytes:
    """The traces drawn side by side, as SVG or PNG bytes (Graphviz's dot lays them out)."""
    return draw(traces).pipe(format=fmt)


def inline_svg(svg: bytes) -> str:
    """An SVG file as an <svg> element to put inside an HTML page: no XML prolog, no DOCTYPE."""
    text = svg.decode("utf-8")
    return text[re.search(r"<svg\b", text).start() :]


def default_path(fmt: str) -> Path:
    return DEFAULT_DIR / f"diagram.{fmt}"


def check_writable(path: Path) -> None:
    """Raise ConfigError if `path` cannot be written, before anything is traced; leaves no file."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and path.is_dir() or existing != path and not existing.is_dir():
        what = "is a folder" if existing == path else f"lies under {existing}, which is not a folder"
        raise ConfigError(f"--out {path}: {what}; accepted is a writable file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ConfigError(
            f"--out {path}: cannot be written ({e.strerror}); accepted is a writable file path"
        ) from None
    if existing != path:
        path.unlink()


__all__ = [
    "FORMATS",
    "ConfigError",
    "check_writable",
    "configs",
    "default_path",
    "inline_svg",
    "render",
    "trace",
    "traceable",
]
