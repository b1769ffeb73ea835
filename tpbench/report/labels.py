"""What the report calls a run: its mode and DP level (`label`, `layout`), its model and setting, its
speed switches, and the order modes and levels are shown in (tpbench.report.data keeps the runs)."""

from __future__ import annotations

from dataclasses import fields

import pandas as pd

from tpbench.config import LRSchedulerConfig, TrainConfig, dp_level_label, layout_label
from tpbench.sizing.defaults import optimizer_label

MODE_ORDER = ("ddp", "tp", "tp_sp", "tp_sp_linear", "tp_vp", "tp_sp_vp")
DP_LEVEL_ORDER = ("none", "optimizer", "grads", "full")  # parallel.dp_shard: DDP, ZeRO-1, ZeRO-2, FSDP


def model_label(flat: dict) -> str:
    """The model of a run (a flat config): its preset's name and the switches that set its family apart
    (two models of one H, S, V and heads are two settings), e.g. "qwen3_0_6b · head_dim 128"."""
    parts = [str(flat.get("model.name", ""))]
    if flat.get("model.head_dim"):
        parts.append(f"head_dim {flat['model.head_dim']}")
    if flat.get("model.qk_norm") is False:
        parts.append("no q/k norm")
    if flat.get("model.attention_bias"):
        parts.append("q/k/v bias")
    return " · ".join(p for p in parts if p)


def with_dp_level(runs: pd.DataFrame, configs: dict[int, dict] | None = None) -> pd.DataFrame:
    """The runs with their DP level beside the mode (tpbench.config.dp_level_label): dp_shard and
    dp_replicate from each config (DDP's replicas for a run without one), `layout` as the command line
    names it (tp=2 dp=2 FSDP), and `label`, what a chart's legend and a table's rows call the run: the
    mode, and its DP level unless DDP's replicas (tp_sp_vp FSDP); mode_rank and level_rank order them."""
    configs = configs or {}
    flat = [configs.get(i, {}) for i in runs["id"]] if "id" in runs else [{}] * len(runs)
    shard = [c.get("parallel.dp_shard", "none") for c in flat]
    replicate = [int(c.get("parallel.dp_replicate", 1)) for c in flat]
    level = [dp_level_label(s, r) for s, r in zip(shard, replicate, strict=True)]
    tp, dp = (runs[k] if k in runs else pd.Series(1, index=runs.index) for k in ("tp", "dp"))
    return runs.assign(
        dp_shard=shard,
        dp_replicate=replicate,
        dp_level=level,
        layout=[layout_label(*a) for a in zip(tp, dp, shard, replicate, strict=True)],
        label=[f"{m} {lv}".strip() for m, lv in zip(runs["mode"], level, strict=True)],
        mode_rank=runs["mode"].map(mode_rank),
        level_rank=[level_rank(s, r) for s, r in zip(shard, replicate, strict=True)],
    )


def levels_in(rows: pd.DataFrame) -> str:
    """What a table or chart title adds to its setting for its rows' DP levels: "" where every row is DDP's
    replicas, else " · DP levels: replicas, ZeRO-1, FSDP (2 replicas)" (rows with mode, label, level_rank)."""
    rows = rows.drop_duplicates("level_rank").sort_values("level_rank")
    levels = [label[len(mode) :].strip() for mode, label in zip(rows["mode"], rows["label"], strict=True)]
    return "" if not any(levels) else " · DP levels: " + ", ".join(lv or "replicas" for lv in levels)


def level_rank(dp_shard: str, dp_replicate: int) -> int:
    """DDP's replicas, ZeRO-1, ZeRO-2, FSDP, each by its replicas (HSDP after), then the rest."""
    order = DP_LEVEL_ORDER.index(dp_shard) if dp_shard in DP_LEVEL_ORDER else len(DP_LEVEL_ORDER)
    return 1000 * order + dp_replicate


def setting_label(run: pd.Series) -> str:
    """One readable line for the setting of a run (the layers apart)."""
    batch = (
        f"mb{run['micro_batch']}" if run["batch_policy"] == "fixed_per_rank" else f"gb{run['global_batch']}"
    )
    return (
        (f"{run['model']}: " if run.get("model") else "")
        + f"H{run['hidden']} S{run['seq']} V{run['vocab']} heads {run['heads']}/{run['kv_heads']} "
        f"{batch} {run['batch_policy']} {run['dtype']} {run['precision']} · {run['world_size']} ranks"
        + (f" · {run['emulated']}" if run.get("emulated") else "")
        + f" · {run['hardware']}"
    )


SWITCHES = {"parallel.overlap": "overlap", "train.fused_optimizer": "fused AdamW", "train.compile": "compile"}


def switches(flat: dict) -> str:
    """The speed switches a run had on (a flat config), e.g. "overlap · fused AdamW", and its gradient
    clipping ("clip 1", train.grad_clip: it costs a step a norm and a scaling); "" for none."""
    on = [label for key, label in SWITCHES.items() if flat.get(key)]
    if flat.get("train.grad_clip"):
        on.append(f"clip {flat['train.grad_clip']:g}")
    return " · ".join(on)


def optimizer_setting(flat: dict) -> str:
    """A run's AdamW weight-decay groups and lr schedule (a flat config), as `fit` says them
    (tpbench.sizing.defaults.optimizer_label), e.g. "no decay on norms+biases"; "" for the defaults."""
    schedule = LRSchedulerConfig(
        **{
            f.name: flat[k]
            for f in fields(LRSchedulerConfig)
            if (k := f"train.lr_scheduler.{f.name}") in flat
        }
    )
    no_decay = list(flat.get("train.no_decay") or [])
    train = TrainConfig(
        weight_decay=flat.get("train.weight_decay", 0.0), no_decay=no_decay, lr_scheduler=schedule
    )
    return optimizer_label(train)


def mode_rank(mode: str) -> int:
    """ddp, tp, tp_sp, tp_sp_linear, tp_vp, tp_sp_vp, then the dtensor_ ones in that order, then the rest."""
    base = mode.removeprefix("dtensor_")
    offset = len(MODE_ORDER) if mode.startswith("dtensor_") else 0
    return offset + MODE_ORDER.index(base) if base in MODE_ORDER else 2 * len(MODE_ORDER)
