"""The tables of sharded data parallelism (docs/results/sharded_dp.md) from a database of runs.

Validation (the default): every level x every mode of one `tpbench sweep kind=validate` database,
each run's worst check against its bound. Per run (a level, `parallel.dp_shard`, under a mode): its
status, each check's worst item as a fraction of its bound (`<check>_of_bound`, at most 1 passes:
tpbench.experiments.criterion), the worst of them, and the busiest rank's CPU seconds
(`validate_cpu_s`).

Memory (`--memory`): the `kind=memory` runs, each rank's measured peak against the model's
(`predicted_peak_bytes`), per level and shape: how many runs (modes) are equal to the byte on every
rank, and the others' differences. Only reads the database:

    .venv/bin/python benchmarks/sharded_dp_table.py --db sqlite:///runs/v38_mixed.db
    .venv/bin/python benchmarks/sharded_dp_table.py --memory --db sqlite:///runs/levels.db --db sqlite:///runs/hsdp.db
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
    ok = (frame["status"] == "OK").sum()
    return markdown(frame) + f"\n{len(frame)} runs, {ok} OK, {len(frame) - ok} not"


def markdown(frame: pd.DataFrame) -> str:
    head = "| " + " | ".join(map(str, frame.columns)) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "".join("| " + " | ".join(map(str, row)) + " |\n" for row in frame.itertuples(index=False))


def memory_table(urls: list[str]) -> str:
    """Per shape x precision (rows) and level (columns): the memory runs equal to the model on every
    rank, of all (one per mode); each other run as its mode, the busiest rank's measured - predicted
    bytes (the model is the busiest rank's) and how far below it its other ranks are, if they are."""
    counts: dict[tuple[str, str], list[int]] = {}
    cells: dict[tuple[str, str], list[str]] = {}
    for url in urls:
        for key, mode, diff, spread in _memory_runs(url):
            tally = counts.setdefault(key, [0, 0])
            tally[0], tally[1] = tally[0] + (diff == 0 and spread == 0), tally[1] + 1
            if diff or spread:
                below = f" (a rank {spread:,} B below)" if spread else ""
                cells.setdefault(key, []).append(f"{mode} {diff:+,} B{below}")
    shapes = sorted({k[0] for k in counts}, key=lambda c: (c.split()[:3], PRECISIONS.index(c.split()[3])))
    levels = sorted({k[1] for k in counts}, key=lambda lv: (lv != lv.split()[0], LEVELS.index(lv.split()[0])))
    rows = []
    for shape in shapes:
        row = {"shape, precision": shape}
        for level in levels:
            equal, n = counts.get((shape, level), (0, 0))
            row[level] = (
                f"{equal} of {n}" + "".join(f"; {c}" for c in cells.get((shape, level), [])) if n else ""
            )
        rows.append(row)
    equal, n = sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())
    return markdown(pd.DataFrame(rows)) + f"\n{n} runs, {equal} equal to the model to the byte on every rank"


PRECISIONS = ("fp32", "bf16", "mixed")


def _memory_runs(url: str):
    """((shape and precision, level), mode, measured - predicted bytes of the busiest rank, the
    spread of the ranks' peaks) of each OK memory run of the database."""
    engine = create_engine(url)
    runs = pd.read_sql(
        "select id, config, layers, vocab, seq, dtype, precision from runs "
        "where kind = 'memory' and status = 'OK'",
        engine,
    )
    peaks = pd.read_sql(
        "select run_id, rank, name, value from measurements "
        "where name in ('peak_bytes', 'predicted_peak_bytes') and step is null",
        engine,
    ).pivot_table(index=["run_id", "rank"], columns="name", values="value")
    by_run = peaks.groupby("run_id")
    off = by_run["peak_bytes"].max() - by_run["predicted_peak_bytes"].max()
    spread = by_run["peak_bytes"].max() - by_run["peak_bytes"].min()
    for r in runs.itertuples():
        config = json.loads(r.config) if isinstance(r.config, str) else r.config
        p = config["parallel"]
        level = p["dp_shard"]
        if p["dp_replicate"] > 1:
            level += f" (HSDP {p['dp_replicate']} x {p['dp'] // p['dp_replicate']})"
        kind = "mixed" if r.precision == "mixed" else {"float32": "fp32", "bfloat16": "bf16"}[r.dtype]
        shape = f"L{r.layers} V{r.vocab} S{r.seq} {kind}"
        yield (shape, level), mode_name(config), int(off[r.id]), int(spread[r.id])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--db", action="append", help="SQLAlchemy URL of the database (--memory: one or more)"
    )
    parser.add_argument("--memory", action="store_true", help="the memory runs against the model")
    args = parser.parse_args()
    urls = args.db or ["sqlite:///runs/tpbench.db"]
    print(memory_table(urls) if args.memory else table(urls[0]))


if __name__ == "__main__":
    main()
