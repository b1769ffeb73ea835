"""The model's shape rules that config checks need before torch loads (tpbench.parallel.checks):
kept apart from tpbench.models.minimind, which imports torch."""

from __future__ import annotations

import math


def default_intermediate_size(hidden_size: int) -> int:
    """MiniMind's MLP width when model.intermediate_size is not given: H x pi, rounded up to 64."""
    return math.ceil(hidden_size * math.pi / 64) * 64
