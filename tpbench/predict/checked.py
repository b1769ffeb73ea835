"""Where the memory model has not been checked against a measured peak, from the config alone.

Torch-free, so that compose can refuse a memory run the model cannot vouch for before torch loads
(`check_measurable`); `plan` predicts it anyway and prints the same reason (tpbench.cli.sharded).
"""

from __future__ import annotations

from tpbench.config import ConfigError, RunConfig


def unchecked(cfg: RunConfig) -> str | None:
    """Why the memory model is not checked against a measured peak for `cfg`, or None."""
    if (k := cfg.train.accumulation) > 1:
        return (
            f"train.accumulation={k} (the memory experiment cannot measure a step of {k} micro-batches: "
            "its tracker, torch's MemTracker, refuses the model's second forward in one step; the model "
            "of such a step, theory.accumulation.step_moments, is checked in-process by "
            "tests/test_accumulation.py)"
        )
    return None


def check_measurable(cfg: RunConfig) -> None:
    """A memory run is refused where the memory model it is measured against is not checked; `plan`
    predicts it anyway and says so."""
    if cfg.kind == "memory" and (why := unchecked(cfg)):
        raise ConfigError(
            f"kind=memory: the memory model is not checked for {why}; accepted are kind=validate or "
            "throughput, or `tpbench plan` for the prediction"
        )
