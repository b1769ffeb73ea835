"""The validation table of sharded data parallelism (docs/results/sharded_dp.md): every level x every
mode of one `tpbench sweep kind=validate` database, each run's worst check against its bound.

Per run (a level, `parallel.dp_shard`, under a mode): its status, each check's worst item as a
fraction of its bound (`<check>_of_bound`, at most 1 passes: tpbench.experiments.criterion), the
worst of them, and the busiest rank's CPU seconds (`validate_cpu_s`). Only reads the database:

    .venv/bin/python benchmarks/sharded_dp_table.py --db sqlite:///runs/v38_mixed.db
"""

from __future__ import annotations

import argparse
import json

import pandas as pd
from sqlalchemy import create_engine

CHECKS = ("fwd_logits_max_abs", "loss_abs_diff", "grad_rel_l2", "adamw_param_rel_l2", "adamw_drift_max_abs")
LEVELS = ("none", "optimizer", "grads", "full")
SHORT = {"fwd_logits_max_abs": "forward", "loss_abs_diff": "loss", "grad_rel_l2": "gradients",
         "adamw_param_rel_l2": "AdamW params", "adamw_drift_max_abs": "AdamW drift"}  # fmt: skip


def mode_name(config: dict) -> str:
    """The conf/mode/ name of a run's parallel settings."""
    p = config["parallel"]
    if p["engine"] == "ddp":
        return "ddp"
    name = "tp" + ("_sp" if p["sp"] else "") + ("_linear" if p["sp"] and p["sp_gather"] == "linear" else "")
    name += "_vp" if p["vp"] else ""
    name = name.replace("_sp_linear_vp", "_sp_vp_linear")
    return ("dtensor_" if p["engine"] == "dtensor" else "") + name


def table(url: str) -> str:
    engine = create_engine(url)
    runs = pd.read_sql(
        "select id, config, status, tp, dp, precision from runs where kind = 'validate'", engine
    )
    metrics = pd.read_sql(
        "select run_id, name, max(value) as value from measurements where step is null group by run_id, name",
        engine,
    ).pivot(index="run_id", columns="name", values="value")
    rows = []
    for r in runs.itertuples():
        config = json.loads(r.config) if isinstance(r.config, str) else r.config
        m = metrics.loc[r.id] if r.id in metrics.index else pd.Series(dtype=float)
        of_bound = [m.get(f"{check}_of_bound", float("nan")) for check in CHECKS]
        worst = max(range(len(CHECKS)), key=lambda i: of_bound[i])
        rows.append({
            "level": config["parallel"]["dp_shard"],
            "mode": mode_name(config),
            "dp x tp": f"{r.dp} x {r.tp}",
            "precision": r.precision,
            "status": r.status,
            **{SHORT[c]: f"{v:.2f}" for c, v in zip(CHECKS, of_bound, strict=True)},
            "worst / bound": f"{of_bound[worst]:.2f} ({SHORT[CHECKS[worst]]})",
            "CPU s": f"{m.get('validate_cpu_s', float('nan')):.1f}",
        })  # fmt: skip
    frame = pd.DataFrame(rows)
    frame["order"] = frame["level"].map(LEVELS.index)
    frame = frame.sort_values(["order", "precision", "mode"]).drop(columns="order")
    head = "| " + " | ".join(frame.columns) + " |\n|" + "---|" * len(frame.columns) + "\n"
    body = "".join("| " + " | ".join(map(str, row)) + " |\n" for row in frame.itertuples(index=False))
    ok = (frame["status"] == "OK").sum()
    return head + body + f"\n{len(frame)} runs, {ok} OK, {len(frame) - ok} not"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="sqlite:///runs/tpbench.db", help="SQLAlchemy URL of the database")
    print(table(parser.parse_args().db))


if __name__ == "__main__":
    main()
