"""`tpbench plan` and sharded DP (parallel.dp_shard, dp_replicate): the per-rank split of the peak, and
DDP, ZeRO-1, ZeRO-2 and FSDP side by side at the config's TP and DP (tpbench.predict.theory.sharding).
"""

from __future__ import annotations

import dataclasses

from rich.table import Table

from tpbench.cli.output import out
from tpbench.config import LEVEL_NAMES, RunConfig, parallel_label

# What holds the peak, each once: they add up to it. The master is a part of the weights (what AdamW
# steps on this rank), shown after the peak, outside the sum.
SPLIT = ("weights", "gradients", "moments", "activations", "temporaries")
PEAK, MASTER = "peak (their sum)", "master (in weights)"


def unsharded(cfg: RunConfig) -> RunConfig:
    """The config with DDP's replicas: dp_shard=none, dp_replicate=1."""
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, dp_shard="none", dp_replicate=1)
    )


def split(cfg: RunConfig, prediction) -> dict[str, int]:
    from tpbench.predict.theory import sharding

    return sharding.split(prediction.dims, sharding.sharding(cfg), prediction.peak)


def split_table(cfg: RunConfig, prediction) -> None:
    """The peak of the config's own level by what holds it (MiB per rank)."""
    title = (
        f"{parallel_label(cfg.parallel)}: the peak per rank ({prediction.peak.name}) by what holds it (MiB)"
    )
    table = Table(title=title)
    for column in (*SPLIT, PEAK, MASTER):
        table.add_column(column, justify="right")
    values = split(cfg, prediction)
    table.add_row(*(_mib(values[k]) for k in SPLIT), _mib(prediction.peak_bytes), _mib(values["master"]))
    out.print(table)
    from tpbench.predict.checked import unchecked

    if why := unchecked(cfg):
        out.print(f"not yet checked against a measured peak: {why}")
    out.print(
        "weights: the parameters on this rank (whole, or its shard with FSDP's gathered blocks); master: "
        "of them, what AdamW steps on this rank (ZeRO-1: its pieces of the buckets, views in pure "
        "precision), so not in the sum; moments: "
        "AdamW's exp_avg, exp_avg_sq and step counters"
    )


def levels_table(cfg: RunConfig) -> None:
    """DDP, ZeRO-1, ZeRO-2 and FSDP at the config's TP and DP: the peak, its split and the DP bytes."""
    from tpbench.predict import theory
    from tpbench.predict.theory.sharding import GRADS, LEVELS, PARAMS, crossing

    if cfg.parallel.dp < 2:
        return
    p, R = cfg.parallel, cfg.parallel.dp_replicate
    replicas = f" ({R} replicas)" if R > 1 else ""
    title = f"sharded DP at tp={p.tp} dp={p.dp}{replicas}: per rank (MiB), DP bytes per step"
    table = Table(title=title)
    for column in ("level", "peak moment", *SPLIT, PEAK, MASTER, "DP MiB/step", "over DDP"):
        table.add_column(column, justify="left" if column in ("level", "peak moment") else "right")
    ddp_bytes = None
    for level in LEVELS:
        c = dataclasses.replace(
            cfg,
            parallel=dataclasses.replace(
                cfg.parallel, dp_shard=level, dp_replicate=1 if level == "none" else R
            ),
        )
        pred = theory.predict(c)
        dp = sum(r.bytes for r in pred.comm_rows() if r.purpose in (GRADS, PARAMS))
        ddp_bytes = dp if ddp_bytes is None else ddp_bytes
        values = split(c, pred)
        cells = [_mib(values[k]) for k in SPLIT]
        bold = "bold" if level == cfg.parallel.dp_shard else None
        table.add_row(
            LEVEL_NAMES[level], pred.peak.name, *cells, _mib(pred.peak_bytes), _mib(values["master"]),
            f"{dp / 2**20:,.1f}", f"{(dp - ddp_bytes) / 2**20:+,.1f}", style=bold,
        )  # fmt: skip
    out.print(table)
    if R > 1:
        cross = crossing(cfg)
        where = {k: "cross nodes" if v else "stay inside a node" for k, v in cross.items()}
        out.print(f"HSDP: the shard group's all-gathers and reduce-scatters {where['shard']}; "
                  f"the replicas' gradient all-reduce {where['replicate']}")  # fmt: skip


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"
