"""Where the memory model has not been checked against a measured peak, from the config alone.

Torch-free, so that compose can refuse a memory run the model cannot vouch for before torch loads
(`check_measurable`); `plan` predicts it anyway and prints the same reason (tpbench.cli.sharded).
"""

from __future__ import annotations

from tpbench.config import ConfigError, RunConfig


def sharded_unchecked(cfg: RunConfig) -> str | None:
    """Why the memory model of a sharded DP level is not checked for `cfg` (None: it is measured equal
    to the model, to the byte, on the CPU: tests/test_theory_sharded.py, docs/results/sharded_dp.md)."""
    if cfg.parallel.dp_shard == "grads" and cfg.train.precision == "mixed":
        return (
            "precision=mixed (at S 4 real gloo ranks peak 132,384 B above the model, at a moment the "
            "emulated rank, equal to it, does not have)"
        )
    return None


def unchecked(cfg: RunConfig) -> str | None:
    """Why the memory model is not checked against a measured peak for `cfg`, or None."""
    why = []
    p, t = cfg.parallel, cfg.train
    if p.overlap and t.recompute != "none" and p.dp > 1 and t.precision == "mixed":
        why.append(
            f"parallel.overlap=true with train.recompute={t.recompute}, parallel.dp={p.dp} and "
            "train.precision=mixed (the top block's down_proj backward beside the fp32 DP buckets: "
            "8 KB off emulated at T 2; checked in pure precision and at dp 1)"
        )
    if sharded := sharded_unchecked(cfg):
        why.append(f"parallel.dp_shard={cfg.parallel.dp_shard} with {sharded}")
    if (k := cfg.train.accumulation) > 1:
        why.append(
            f"train.accumulation={k} (the gradients held from one micro-batch to the next at each moment "
            "of a later one's step are not modelled: FSDP2's unsharded ones with its sync off, DDP's and "
            "ZeRO-1's accumulating in place; the model is one micro-batch's step)"
        )
    return "; ".join(why) or None


def check_measurable(cfg: RunConfig) -> None:
    """A memory run is refused where the memory model it is measured against is not checked; `plan`
    predicts it anyway and says so."""
    if cfg.kind == "memory" and (why := unchecked(cfg)):
        raise ConfigError(
            f"kind=memory: the memory model is not checked for {why}; accepted are kind=validate or "
            "throughput, or `tpbench plan` for the prediction"
        )
