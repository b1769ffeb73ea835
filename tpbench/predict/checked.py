"""Where the memory model has not been checked against a measured peak, from the config alone.

Torch-free, so that compose can refuse a memory run the model cannot vouch for before torch loads
(`check_measurable`); `plan` predicts it anyway and prints the same reason (tpbench.cli.sharded).
"""

from __future__ import annotations

from tpbench.config import ConfigError, RunConfig


def unchecked(cfg: RunConfig) -> str | None:
    """Why the memory model is not checked against a measured peak for `cfg`, or None: None for every
    other config compose accepts since train.accumulation's step was measured to the byte
    (tests/test_accumulation.py); where a feature's memory is modelled before it is measured, its
    reason goes here, and `plan` notes it and compose refuses its memory run. (The last one,
    train.recompute=op with dropout, measured 115 KB above the prediction at tp 2, dp 2, S 128, is
    modelled since 2026-12-07: tests/test_theory.py, `dp2_tp_op_dropout`.)"""
    del cfg
    return None


def check_measurable(cfg: RunConfig) -> None:
    """A memory run is refused where the memory model it is measured against is not checked; `plan`
    predicts it anyway and says so."""
    if cfg.kind == "memory" and (why := unchecked(cfg)):
        raise ConfigError(
            f"kind=memory: the memory model is not checked for {why}; accepted are kind=validate or "
            "throughput, or `tpbench plan` for the prediction"
        )
