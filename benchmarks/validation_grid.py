"""The validation grid: many seeds of three shapes, every tensor-parallel mode, fp32, bf16 and mixed
precision, to show that a correct model never fails validation (docs/results/validation.md).

Each part is one `tpbench sweep` (its runs on warm workers, `train.seed=` an axis), labelled with
`sweep=grid_<part>` in the database; `--parts` picks which run. The bf16 and mixed parts run their
GEMMs as a GPU does, fp32 accumulation rounded once (`launch.bf16_gemm=fp32_accumulate`,
tpbench.models.gemm: on a 2-core AVX2 CPU torch's native bf16 matmuls are ~40-90x slower than fp32);
`--bf16-gemm native` runs torch's kernels instead, labelled `grid_<part>_native`. `--report` only
reads the database: per part the runs, the failures, the CPU time of a run, each check's worst value
/ bound, and the largest ratio of sharded-vs-dense to dense-vs-reference among the figures above
their floor (what K has to cover); `--compare DB` sets each run beside the same run (mode, T, seed)
of another database.

    .venv/bin/python benchmarks/validation_grid.py --seeds 20 --parts tiny_fp32 tiny_t4_fp32
    .venv/bin/python benchmarks/validation_grid.py --report
    .venv/bin/python benchmarks/validation_grid.py --report --db sqlite:///runs/a.db --compare sqlite:///runs/b.db
    .venv/bin/python benchmarks/validation_grid.py --dense-cost
    .venv/bin/python benchmarks/validation_grid.py --planted --db sqlite:///runs/planted_bugs.db
    .venv/bin/python benchmarks/validation_grid.py --planted --bugs scale --scales 1.03,1.04 --db ...
    .venv/bin/python benchmarks/validation_grid.py --planted --ladder --db sqlite:///runs/ladders.db
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

MODES_T2 = "tp,tp_sp,tp_sp_linear,tp_vp,tp_sp_vp,dtensor_tp,dtensor_tp_sp,dtensor_tp_vp,dtensor_tp_sp_vp"
# The issue's Llama config.json: no intermediate_size, so transformers' default 11,008
LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}
SHAPES = {
    "tiny": ["model=tiny"],
    "seed": ["model=seed_check"],
    "llama": ["model.hf_config={llama}"],
    # issue 56 item 7's held-out shape, never used to set anything: 3 layers, head_dim 12, 8 heads over
    # 4 KV heads (replicated at T 8 only), vocabulary 384 (VP: 96 or 192 rows a rank)
    "fresh": ["model=tiny", "layers=3", "hidden=96", "heads=8", "kv_heads=4", "vocab=384"],
}
# How many of a seed's modes are validated beside one dense model (launch.share_dense): all 9 where
# they fit in memory; the Llama shape's 9 held up to 11 GB a rank (an OOM kill beside the test suite)
SHARE = {"tiny": 9, "seed": 9, "llama": 4, "fresh": 9}
DTYPES = {
    "fp32": ["dtype=float32"],
    "bf16": ["dtype=bfloat16"],
    "mixed": ["dtype=bfloat16", "precision=mixed"],  # fp32 master weights, the forward in bf16
}
# part name -> (shape, dtype, tp, modes)
PARTS = {
    f"{shape}_{t}{dtype}": (shape, dtype, tp, modes)
    for shape in SHAPES
    for dtype in DTYPES
    for t, tp, modes in (("", 2, MODES_T2), ("t4_", 4, "tp_sp_vp"))
}
# The planted bugs, each a sweep of its own on the tiny model at T 2, mode tp_sp, in every precision
# (sweep=bug_<name>_<precision>); each run must fail. grad_scale: one gradient off by 2, 5 and 10%
PLANTED = {
    "qk": ["debug.skip_grad_sum=[qk_norm]"],
    "sp": ["debug.skip_grad_sum=[sp_norms]"],
    "kv": ["kv_heads=1", "debug.skip_grad_sum=[kv_replicas]"],
    "dp": ["dp=2", "debug.skip_grad_sum=[dp]"],
    "fault": ["debug.validate_fault=rope_offset,no_backward_sum"],
    "scale": ["debug.grad_scale=1.02,1.05,1.1"],
    # issue 56 item 6's classes: a bug that starts at step 5, the DP reduction in bf16 where mixed
    # promises fp32 (a no-op in fp32 and pure bf16, whose reduction is in the compute dtype by design),
    # one vocabulary row's and one head's gradient off, the sharded AdamW's own faults
    "late": ["debug.skip_grad_sum=[sp_norms]", "debug.from_step=5"],
    "lowp": ["dp=2", "debug.low_precision_reduce=true"],
    "row": ["debug.row_grad_scale=1.05"],
    "head": ["debug.head_grad_scale=1.05"],
    # with weight decay on all but the norms and a warm-up, where either fault changes the update
    "optim": [
        "debug.optim_fault=decay_norm,lr_ahead",
        "train.weight_decay=0.1",
        "train.no_decay=[norms]",
        "train.lr_scheduler.warmup_steps=2",
    ],
}
ONLY_IN = {"lowp": ("dtypebfloat16precisionmixed",)}  # a class planted in these precisions only
# The magnitude classes' factor ladders (--ladder), per precision: the smallest factor that fails is the
# smallest error the checks detect in that class (issue 56 item 7)
SCALED = {"scale": "grad_scale", "row": "row_grad_scale", "head": "head_grad_scale"}
LADDERS = {
    "dtypefloat32": "1.000005,1.00001,1.00002,1.00005,1.0001",
    "dtypebfloat16": "1.01,1.02,1.03,1.04,1.05,1.06,1.08,1.1,1.15,1.2",
    "dtypebfloat16precisionmixed": "1.01,1.02,1.03,1.04,1.05,1.06,1.08,1.1,1.15,1.2",
}
PRECISIONS = {
    "dtypefloat32": ["dtype=float32"],
    "dtypebfloat16": ["dtype=bfloat16"],
    "dtypebfloat16precisionmixed": ["dtype=bfloat16", "precision=mixed"],
}
CHECKS = {  # check -> (its value, its reference) in the measurements, or None: per parameter
    "fwd_logits_max_abs": ("fwd_logits_max_abs", "dense_fwd_logits_max_abs"),
    "loss_abs_diff": ("loss_abs_diff", "dense_token_loss_mean_abs_diff"),
    "grad_rel_l2": None,
    "adamw_param_rel_l2": None,
    "adamw_drift_max_abs": ("adamw_drift_max_abs", "dense_adamw_drift_max_abs"),
}
# checks whose per-parameter figures the database does not keep: their worst figure / bound only (the
# gradient's worst row; the optimizer and the DP reduction on identical inputs, issue 56 items 3 and 6)
OF_BOUND_ONLY = ("grad_row_rel_l2", "optimizer_update", "optimizer_gather", "dp_reduce")
FLOORS = {  # ValidateConfig's defaults, the floors (tpbench.experiments.criterion)
    "fwd_logits_max_abs": 1e-5,
    "loss_abs_diff": 1e-5,
    "grad_rel_l2": 1e-5,
    "adamw_param_rel_l2": 1e-3,
    "adamw_drift_max_abs": 2e-3,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="train.seed=0..N-1 (default 20)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument(
        "--parts", nargs="*", default=list(PARTS), help=f"of {', '.join(PARTS)} (default all)"
    )
    parser.add_argument("--modes", default="", help="override every part's mode list, e.g. tp,tp_sp_vp")
    parser.add_argument("--db", default="sqlite:///runs/validation_grid.db")
    parser.add_argument("--planted", action="store_true", help="run the planted bugs (PLANTED) instead")
    parser.add_argument(
        "--precisions",
        nargs="*",
        default=list(PRECISIONS),
        help=f"with --planted: of {', '.join(PRECISIONS)}",
    )
    parser.add_argument(
        "--bugs", nargs="*", default=list(PLANTED), help=f"with --planted: of {', '.join(PLANTED)}"
    )
    parser.add_argument(
        "--scales", default="", help="with --planted: the scale bug's debug.grad_scale list, e.g. 1.03,1.04"
    )
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="with --planted: each magnitude class of --bugs (scale, row, head) over its precision's factor "
        "ladder (LADDERS), labelled bug_<name>ladder_<precision>",
    )
    parser.add_argument(
        "--bf16-gemm",
        choices=("fp32_accumulate", "native"),
        default="fp32_accumulate",
        help="the bf16 parts' launch.bf16_gemm (default fp32_accumulate: a GPU's bf16 GEMM at fp32 speed; "
        "native parts are labelled grid_<part>_native)",
    )
    parser.add_argument(
        "--dense-cost",
        action="store_true",
        help="in this process: the CPU time of one step of the dense model and of its reference per shape "
        "(what every rank of every run steps beside its shard)",
    )
    parser.add_argument("--report", action="store_true", help="only read the database")
    parser.add_argument(
        "--compare",
        metavar="DB",
        default="",
        help="with --report: the runs of --db against the same runs (mode, T, seed) of this database, "
        "e.g. bf16 native against fp32_accumulate",
    )
    args = parser.parse_args()
    if args.dense_cost:
        return dense_cost()
    if unknown := set(args.parts) - set(PARTS):
        sys.exit(f"--parts {sorted(unknown)}: accepted are {', '.join(PARTS)}")
    if unknown := set(args.precisions) - set(PRECISIONS):
        sys.exit(f"--precisions {sorted(unknown)}: accepted are {', '.join(PRECISIONS)}")
    if unknown := set(args.bugs) - set(PLANTED):
        sys.exit(f"--bugs {sorted(unknown)}: accepted are {', '.join(PLANTED)}")
    if args.planted and not args.report:
        for name in args.bugs:
            for tag in args.precisions:
                if tag not in ONLY_IN.get(name, PRECISIONS):
                    continue
                precision = PRECISIONS[tag]
                overrides, label = PLANTED[name], name
                if name == "scale" and args.scales:
                    overrides = [f"debug.grad_scale={args.scales}"]
                if args.ladder:
                    if name not in SCALED:
                        continue
                    overrides, label = [f"debug.{SCALED[name]}={LADDERS[tag]}"], f"{name}ladder"
                sweep = [
                    "kind=validate",
                    "tp=2",
                    "mode=tp_sp",
                    *precision,
                    *overrides,
                    f"sweep=bug_{label}_{tag}",
                ]
                tpbench = str(Path(sys.executable).parent / "tpbench")
                subprocess.run(
                    [tpbench, "sweep", *sweep, f"db.url={args.db}"], stdout=subprocess.DEVNULL, check=False
                )
    elif not args.report:
        # a fixed folder: the model's name is its folder's, and the name is part of a run's identity,
        # so that a sweep run again skips the runs its database has
        llama = Path("runs") / "llama_h256_l4" / "config.json"
        llama.parent.mkdir(parents=True, exist_ok=True)
        llama.write_text(json.dumps(LLAMA))
        for part in args.parts:
            run_part(part, args, llama)
    if args.compare:
        print(compare(args.db, args.compare))
    else:
        print(planted(args.db) if args.planted else report(args.db))


def run_part(part: str, args: argparse.Namespace, llama: Path) -> None:
    shape, dtype, tp, modes = PARTS[part]
    seeds = ",".join(str(s) for s in range(args.first_seed, args.first_seed + args.seeds))
    overrides = [o.format(llama=llama) for o in SHAPES[shape]] + DTYPES[dtype]
    label = part
    if dtype in ("bf16", "mixed"):
        overrides.append(f"launch.bf16_gemm={args.bf16_gemm}")
        label += "_native" if args.bf16_gemm == "native" else ""
    command = [
        str(Path(sys.executable).parent / "tpbench"),
        "sweep",
        "kind=validate",
        *overrides,
        f"tp={tp}",
        f"launch.share_dense={SHARE[shape]}",
        # the modes of a seed next to each other: warm workers validate them beside one dense model
        f"train.seed={seeds}",
        f"mode={args.modes or modes}",
        f"sweep=grid_{label}",
        f"db.url={args.db}",
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, stdout=subprocess.DEVNULL, check=False)


def dense_cost() -> None:
    """Per shape and precision (bf16 fp32-accumulated), the CPU seconds of one step (forward, backward,
    AdamW) of the dense model and of its reference on the run's global batch, one thread, the second of
    two steps: what every rank of a validation steps beside its own shard."""
    import copy
    import time

    import torch

    from tpbench.experiments.setup import build_dense, place
    from tpbench.models.gemm import bf16_gemms
    from tpbench.run import compose

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        llama = Path(tmp) / "config.json"
        llama.write_text(json.dumps(LLAMA))
        for shape, overrides in SHAPES.items():
            for dtype, precision in (("float32", torch.float64), ("bfloat16", torch.float32)):
                gemm = ["launch.bf16_gemm=fp32_accumulate"] if dtype == "bfloat16" else []
                shaped = [o.format(llama=llama) for o in overrides]
                (cfg,) = compose.expand(["kind=validate", "tp=2", *shaped, f"dtype={dtype}", *gemm])
                batch = cfg.train.global_batch or cfg.train.micro_batch
                ids = torch.randint(0, cfg.model.vocab_size, (batch, cfg.train.seq_len))
                dense = build_dense(cfg)
                reference = place(copy.deepcopy(dense), torch.device("cpu"), precision)
                place(dense, torch.device("cpu"), getattr(torch, dtype))
                seconds = []
                for model, mode in ((dense, cfg.launch.bf16_gemm), (reference, "native")):
                    opt = torch.optim.AdamW(model.parameters(), lr=cfg.validate.lr)
                    for _ in range(2):
                        start = time.process_time()
                        with bf16_gemms(mode):
                            model(ids, ids)[1].backward()
                        opt.step()
                        opt.zero_grad()
                    seconds.append(time.process_time() - start)
                print(
                    f"{shape} {dtype}: dense {seconds[0]:.2f} s, reference ({precision}) {seconds[1]:.2f} s "
                    f"a step (batch {batch}, S {cfg.train.seq_len})",
                    flush=True,
                )


def _by_run(url: str) -> pd.DataFrame:
    """Each finished grid run's verdict and each check's worst figure / bound, keyed by (mode, tp,
    seed)."""
    from tpbench.db import ResultsDB

    db = ResultsDB(url)
    runs = db.runs(kind="validate")
    runs = runs[runs["sweep"].fillna("").str.startswith("grid_") & runs["status"].isin(["OK", "FAILED"])]
    metrics = db.metrics(runs["id"].tolist())
    seeds = [db.run_record(int(i))["config"]["train"]["seed"] for i in runs["id"]]
    table = runs.assign(seed=seeds).set_index("id")[["mode", "tp", "seed", "status"]]
    table = table.join(metrics[[f"{check}_of_bound" for check in CHECKS]])
    return table.set_index(["mode", "tp", "seed"])


def compare(url: str, other: str) -> str:
    """A markdown table: per run of both databases, the status of each and, per check, its worst
    figure / bound in each (this database's first); then per check the largest ratio of the two."""
    a, b = _by_run(url), _by_run(other)
    both = a.add_suffix("_a").join(b.add_suffix("_b"), how="inner")
    lines = ["| mode | T | seed | status | " + " | ".join(CHECKS) + " |", "|---" * (4 + len(CHECKS)) + "|"]
    ratios = {check: [] for check in CHECKS}
    for (mode, tp, seed), r in both.iterrows():
        cells = []
        for check in CHECKS:
            x, y = r[f"{check}_of_bound_a"], r[f"{check}_of_bound_b"]
            cells.append(f"{x:.2f} / {y:.2f}")
            if x > 0 and y > 0:
                ratios[check].append(max(x / y, y / x))
        status = r["status_a"] if r["status_a"] == r["status_b"] else f"{r['status_a']} / {r['status_b']}"
        lines.append(f"| {mode} | {tp} | {seed} | {status} | " + " | ".join(cells) + " |")
    same = int((both["status_a"] == both["status_b"]).sum())
    lines += [
        "",
        f"{len(both)} runs in both, {same} with the same status; the largest factor between the two's "
        "figure / bound, per check: "
        + ", ".join(f"{check} {max(v):.2f}" for check, v in ratios.items() if v),
    ]
    return "\n".join(lines)


# criterion.Verdict.failure: the check, its worst parameter (none for a whole-model figure), the step
# of a per-step check's worst figure, the figure and its bound
FAILURE = re.compile(r"(\w+)(?: (model\.\S+))?(?: at step (\d+))? (\S+) > bound (\S+)")


def failures(error: str) -> list[tuple[str, str, int | None, float]]:
    """A FAILED run's error line as (check, parameter or "", step or None, value / bound) per check."""
    found = []
    for check, name, step, value, bound in FAILURE.findall(error or ""):
        ratio = float(value) / float(bound) if float(bound) > 0 else float("inf")
        found.append((check, name.removeprefix("model."), int(step) if step else None, ratio))
    return found


def planted(url: str) -> str:
    """Two markdown tables of the planted bugs. Per run: its status, each check it failed with the
    parameter and its worst step named and how far past its bound (value / bound, from the error line's
    rounded figures), the worst of them, and the scaled q_proj's gradient against its bound. Per
    magnitude class and precision (the ladders): the largest factor that passed, the smallest that failed."""
    from tpbench.db import ResultsDB

    db = ResultsDB(url)
    runs = db.runs(kind="validate")
    runs = runs[runs["sweep"].fillna("").str.startswith("bug_")]
    metrics = db.metrics(runs["id"].tolist())
    params = db.param_errors(runs["id"].tolist())
    scaled = params[(params["rank"] == 0) & (params["name"] == "model.layers.0.self_attn.q_proj.weight")]
    scaled = scaled.set_index("run_id")
    lines = [
        "| bug | precision | status | failed checks: parameter, worst step (x its bound) | worst x bound | "
        "max grad rel L2 (dense's own) | scaled grad / bound |",
        "|---" * 7 + "|",
    ]
    ladders: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for _, run in runs.iterrows():
        _, name, tag = run["sweep"].split("_", 2)
        debug = db.run_record(int(run["id"]))["config"]["debug"]
        if name.endswith("ladder"):
            factor = debug[SCALED[name.removesuffix("ladder")]]
            ladders.setdefault((name.removesuffix("ladder"), tag), []).append((factor, run["status"]))
            name = f"{name.removesuffix('ladder')} x {factor!r}"
        else:
            name = {"fault": debug["validate_fault"], "optim": debug["optim_fault"]}.get(name, name)
            if debug["grad_scale"] != 1:
                name = f"grad x {debug['grad_scale']:g}"
        m = metrics.loc[run["id"]] if run["id"] in metrics.index else {}
        first: dict[str, tuple[str, int, float]] = {}
        for check, parameter, step, ratio in failures(run["error"]):
            first.setdefault(check, (parameter, step, ratio))
        where = {c: ", ".join(x for x in (p, s and f"step {s}") if x) for c, (p, s, _) in first.items()}
        cells = "; ".join(f"{c}: {where[c] or 'the model'} (x{r:.3g})" for c, (_, _, r) in first.items())
        worst = max((r for *_, r in failures(run["error"])), default=float("nan"))
        q = scaled.loc[run["id"]] if run["id"] in scaled.index else None
        bound = 4 * q["grad_ref_rel_l2"] + FLOORS["grad_rel_l2"] if q is not None else float("nan")
        q_cell = f"{q['grad_rel_l2']:.3g} / {bound:.3g}" if q is not None else "-"
        grad, own = m.get("grad_max_rel_l2", float("nan")), m.get("dense_grad_max_rel_l2", float("nan"))
        lines.append(
            f"| {name} | {tag.removeprefix('dtype')} | {run['status']} | {cells} | {worst:.3g} | "
            f"{grad:.3g} ({own:.3g}) | {q_cell} |"
        )
    if ladders:
        head = "| class | precision | largest factor passed | smallest factor failed | runs |"
        lines += ["", head, "|---" * 5 + "|"]
        for (name, tag), tried in sorted(ladders.items()):
            passed = [f for f, status in tried if status == "OK"]
            failed = [f for f, status in tried if status == "FAILED"]
            lines.append(
                f"| {name} | {tag.removeprefix('dtype')} | {max(passed, default=float('nan'))!r} | "
                f"{min(failed, default=float('nan'))!r} | {len(tried)} |"
            )
    return "\n".join(lines)


def report(url: str) -> str:
    """A markdown table per part: runs, failures, the worst value / bound and the largest ratio above
    the floor per check; then the parameters nearest their bound."""
    from tpbench.db import ResultsDB

    db = ResultsDB(url)
    runs = db.runs(kind="validate")
    runs = runs[runs["sweep"].fillna("").str.startswith("grid_")]
    if runs.empty:
        return "no grid runs in " + url
    metrics = db.metrics(runs["id"].tolist())
    params = db.param_errors(runs["id"].tolist())
    params = params[params["rank"] == 0]
    lines = [
        "| part | runs | OK | failed | stopped | CPU s per rank (median; max) | "
        + " | ".join(f"{c} worst of bound (max ratio; above floor)" for c in CHECKS)
        + " | "
        + " | ".join(f"{c} worst of bound" for c in OF_BOUND_ONLY)
        + " |",
        "|---" * (6 + len(CHECKS) + len(OF_BOUND_ONLY)) + "|",
    ]
    for sweep, group in runs.groupby("sweep", sort=False):
        ids = group["id"].tolist()
        m = metrics.loc[metrics.index.isin(ids)]
        cells = []
        for check, pair in CHECKS.items():
            of_bound = m[f"{check}_of_bound"].max() if f"{check}_of_bound" in m else float("nan")
            if pair is None:
                field = "grad" if check == "grad_rel_l2" else "param"
                p = params[params["run_id"].isin(ids)]
                value, ref = p[f"{field}_rel_l2"], p[f"{field}_ref_rel_l2"]
            else:
                value, ref = m[pair[0]], m[pair[1]]
            ratio = (value / ref)[ref > 0].max()  # what K has to cover, where the floor does not
            above = value > FLOORS[check]
            over = (value[above] / ref[above]).max() if above.any() else float("nan")
            cells.append(f"{of_bound:.2f} ({ratio:.2f}; {over:.2f})")
        for check in OF_BOUND_ONLY:  # "-": not run (no DP: no reduction check; ZeRO-1's gather only)
            column = m.get(f"{check}_of_bound", pd.Series(dtype=float)).dropna()
            cells.append(f"{column.max():.2f}" if len(column) else "-")
        ok = int((group["status"] == "OK").sum())
        cpu = m["validate_cpu_s"].dropna() if "validate_cpu_s" in m else pd.Series(dtype=float)
        cpu_cell = f"{cpu.median():.1f}; {cpu.max():.1f}" if len(cpu) else "-"
        failed = int((group["status"] == "FAILED").sum())  # else stopped: INTERRUPTED, TIMEOUT
        stopped = len(group) - ok - failed
        head = f"| {sweep[5:]} | {len(group)} | {ok} | {failed} | {stopped} | {cpu_cell} | "
        lines.append(head + " | ".join(cells) + " |")
    worst = params.assign(
        of_bound=params["grad_rel_l2"] / (4 * params["grad_ref_rel_l2"] + FLOORS["grad_rel_l2"])
    )
    worst = worst.merge(runs[["id", "sweep", "mode", "tp", "dtype"]], left_on="run_id", right_on="id")
    lines += [
        "",
        "Gradients nearest their bound:",
        "",
        "| part | mode | run | parameter | rel L2 | reference | of bound |",
    ]
    lines.append("|---" * 7 + "|")
    for _, r in worst.nlargest(5, "of_bound").iterrows():
        lines.append(
            f"| {r['sweep'][5:]} | {r['mode']} | {r['run_id']} | {r['name']} | {r['grad_rel_l2']:.3g} | "
            f"{r['grad_ref_rel_l2']:.3g} | {r['of_bound']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    pd.set_option("display.width", 200)
    main()
