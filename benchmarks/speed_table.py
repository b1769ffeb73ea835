"""The speed table of docs/results/speed.md from benchmarks/speed_loop.sh's log and database: per setting the
median step of the repetitions, each run over its own GEMM limit (the run's counted FLOPs / 2 ranks /
the mean of the GEMM rates measured either side of it; minimind-tron's steps over tpbench's TP limit,
the same FLOPs: the LM head whole on each rank), over minimind-tron's TP step, and each switch's effect
per repetition. Run: python benchmarks/speed_table.py runs/speed.log runs/speed.db"""

import json
import re
import sqlite3
import statistics as st
import sys

SETTING = {"overlap=false": "fused AdamW", "overlap=true": "fused, overlap", "compile=true": "fused, compile"}
PAIRS = [  # (off, on): a switch's effect, repetition by repetition
    (("tp", "fused AdamW"), ("tp", "fused, overlap")),
    (("tp_sp", "fused AdamW"), ("tp_sp", "fused, overlap")),
    (("tp_vp", "fused AdamW"), ("tp_vp", "fused, overlap")),
    (("tron tp", "(its own)"), ("tron tp", "async")),
    (("tron tp+sp", "(its own)"), ("tron tp+sp", "async")),
]


def main(log_path: str, db_path: str) -> None:
    db = sqlite3.connect(db_path)

    def metric(run_id, name, over_ranks=max):
        query = "select value from measurements where run_id=? and name=?"
        values = [v for (v,) in db.execute(query, (run_id, name))]
        return over_ranks(values) if values else None

    runs = {}
    for run_id, mode, status, config in db.execute("select id, mode, status, config from runs"):
        c = json.loads(config)
        setting = (
            "compile=true" if c["train"]["compile"] else f"overlap={str(c['parallel']['overlap']).lower()}"
        )
        runs[(mode, setting, c["train"]["seed"])] = (run_id, status)

    lines = open(log_path).read().splitlines()
    events = [line.split(" ", 1) for line in lines if line.startswith(("RATE ", "RUN "))]
    rows: dict[tuple[str, str], list[dict]] = {}
    for i, (kind, text) in enumerate(events):
        if kind != "RUN":
            continue
        near = [events[j] for j in (i - 1, i + 1) if 0 <= j < len(events)]
        rate = st.mean(float(t) for k, t in near if k == "RATE") * 1e9
        rep, seed = map(int, re.search(r"rep=(\d+) seed=(\d+)", text).groups())
        row = {"rep": rep, "rate": rate, "flops": None, "comm": None, "hidden": None}
        if " tron " in text:
            sp, asy = re.search(r"sp=(\d) async=(\d)", text).groups()
            row["step"] = json.loads(text.split("TRON_STEP=")[1])["median_s"]
            key = ("tron tp" + ("+sp" if sp == "1" else ""), "async" if asy == "1" else "(its own)")
        else:
            *_, mode, setting, rc = text.split()
            run_id, status = runs[(mode, setting, seed)]
            if rc != "rc=0" or status != "OK":
                sys.exit(f"{text}: run {run_id} is {status}")
            key = (mode, SETTING[setting])
            row["step"] = metric(run_id, "step_time_s")
            row["flops"] = metric(run_id, "flops_per_step")
            row["comm"] = metric(run_id, "comm_time_s", st.mean) / row["step"]
            row["hidden"] = metric(run_id, "comm_hidden_fraction", min)
        rows.setdefault(key, []).append(row)

    tp_flops = rows[("tp", "fused AdamW")][0]["flops"]
    tron_tp = st.median(r["step"] for r in rows[("tron tp", "(its own)")])
    rates = [float(t) for k, t in events if k == "RATE"]
    print(f"GEMM rate, {len(rates)} measurements: {min(rates):.1f}-{max(rates):.1f} GFLOP/s, ", end="")
    print(f"median {st.median(rates):.1f}")
    reps = len(rows[("tp", "fused AdamW")])
    print(f"| mode | setting | step (s), median of {reps} | the {reps} runs | of GEMM limit |", end="")
    print(" of tron's TP step |", end="")
    print(" comm / step | comm hidden |\n|---|---|---|---|---|---|---|---|")
    for (mode, setting), rs in rows.items():
        rs.sort(key=lambda r: r["rep"])
        steps = [r["step"] for r in rs]
        of_limit = st.median(r["step"] / ((r["flops"] or tp_flops) / 2 / r["rate"]) for r in rs)
        comm = f"{st.median(r['comm'] for r in rs):.1%}" if rs[0]["comm"] is not None else ""
        hidden = f"{st.median(r['hidden'] for r in rs):.2f}" if rs[0]["hidden"] is not None else ""
        cells = [mode, setting, f"{st.median(steps):.3f}", ", ".join(f"{s:.3f}" for s in steps)]
        cells += [f"{of_limit:.3f}", f"{st.median(steps) / tron_tp:.3f}", comm, hidden]
        print("| " + " | ".join(cells) + " |")
    for off, on in PAIRS:
        ratios = [b["step"] / a["step"] for a, b in zip(rows[off], rows[on], strict=True)]
        each = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"{off[0]}: {on[1]} / {off[1]}, per repetition {each}; median {st.median(ratios):.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
