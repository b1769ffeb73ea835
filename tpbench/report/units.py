"""Numbers as a reader wants them: with their unit, and a dash where there is none."""

from __future__ import annotations

import math
from collections.abc import Callable

MIB = 2**20
DASH = "—"


def _guard(fmt: Callable[[float], str]) -> Callable[[object], str]:
    def safe(value: object) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return DASH
        return fmt(float(value))  # type: ignore[arg-type]

    return safe


mib = _guard(lambda v: f"{v / MIB:,.1f} MiB")
ms = _guard(lambda v: f"{v * 1e3:,.2f} ms")
tokens_per_s = _guard(lambda v: f"{v:,.0f} tokens/s")
sci = _guard(lambda v: f"{v:.2e}")
percent = _guard(lambda v: f"{v:.1%}")
signed_percent = _guard(lambda v: f"{v:+.1%}")
count = _guard(lambda v: f"{v:,.0f}")
ratio = _guard(lambda v: f"{v:.2f}x")


@_guard
def flops(v: float) -> str:
    """FLOPs in the largest decimal unit that keeps the number >= 1."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(v) >= scale:
            return f"{v / scale:,.2f} {unit}"
    return f"{v:,.0f} FLOP"


@_guard
def size(v: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= scale:
            return f"{v / scale:,.1f} {unit}"
    return f"{v:,.0f} B"


def passed(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    return "passed" if value else "FAILED"


def text(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    return str(value)
