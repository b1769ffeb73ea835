"""A sweep's per-run overhead, with warm workers (launch.reuse_workers=true) and without (a fresh
torchrun job per run): the same sweep of tiny configs, each way, in a fresh folder, and what each run
costs beyond its experiment. docs/results/sweep-overhead.md has its output on this project's machine.

    .venv/bin/python benchmarks/sweep_overhead.py                     # 8 runs: 4 modes x validate, memory
    .venv/bin/python benchmarks/sweep_overhead.py mode=tp,tp_sp kind=memory train.steps=1   # your sweep

The experiment's own time is rank 0's in the experiment function (tpbench.experiments.experiment's,
timed in every worker by a sitecustomize this script puts on the workers' PYTHONPATH); everything else
is overhead: the agent, the rendezvous, the imports, the process group, handing in the results,
recording them.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWEEP = ["kind=validate,memory", "mode=tp,tp_sp,tp_vp,tp_sp_vp", "validate.steps=2", "validate.every=1"]

# Times each experiment on rank 0: one JSON line per run into $SWEEP_OVERHEAD_TIMES.
TIMER = """
import json, os, time
import tpbench.experiments as experiments

_experiment = experiments.experiment


def experiment(kind):
    run = _experiment(kind)

    def timed(cfg):
        start = time.perf_counter()
        result = run(cfg)
        if os.environ.get("RANK", "0") == "0":
            with open(os.environ["SWEEP_OVERHEAD_TIMES"], "a") as f:
                f.write(json.dumps({"kind": kind, "s": time.perf_counter() - start}) + "\\n")
        return result

    return timed


experiments.experiment = experiment
"""


def sweep(overrides: list[str], reuse: bool) -> dict[str, float]:
    """Run the sweep in a fresh folder: its run count, wall time and the runs' experiment time, and the
    overhead of its first run and of each later one."""
    work = Path(tempfile.mkdtemp(prefix="tpbench-overhead-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(TIMER)
    times = work / "times.jsonl"
    path = os.pathsep.join([str(work / "site"), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, SWEEP_OVERHEAD_TIMES=str(times), TMPDIR=str(work))
    env.setdefault("OMP_NUM_THREADS", "1")
    reusing = f"launch.reuse_workers={str(reuse).lower()}"
    command = [sys.executable, "-m", "tpbench", "sweep", *overrides, reusing, "--json"]
    began, start = datetime.now(UTC).replace(tzinfo=None), time.perf_counter()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    experiments = [json.loads(line)["s"] for line in times.read_text().splitlines()]
    with sqlite3.connect(work / "runs" / "tpbench.db") as db:
        ends = [datetime.fromisoformat(end) for (end,) in db.execute("SELECT ended_at FROM runs ORDER BY id")]
    runs = len(ends)
    first = (ends[0] - began).total_seconds() - experiments[0]
    later = ((ends[-1] - ends[0]).total_seconds() - sum(experiments[1:])) / max(1, runs - 1)
    return {"runs": runs, "wall": wall, "experiment": sum(experiments), "first": first, "later": later}


def main() -> None:
    overrides = sys.argv[1:] or SWEEP
    load = os.getloadavg()[0]
    print(f"tpbench sweep {' '.join(overrides)}")
    print(f"CPU, {os.cpu_count()} cores, OMP_NUM_THREADS=1, load average {load:.1f} at the start")
    print(f"{'reuse_workers':<15}{'runs':>5}{'wall s':>9}{'experiment s':>14}{'overhead s/run':>16}", end="")
    print(f"{'first run s':>13}{'each later s':>14}")
    for reuse in (False, True):
        f = sweep(overrides, reuse)
        overhead = (f["wall"] - f["experiment"]) / f["runs"]
        print(f"{str(reuse).lower():<15}{f['runs']:>5}{f['wall']:>9.1f}{f['experiment']:>14.1f}", end="")
        print(f"{overhead:>16.2f}{f['first']:>13.1f}{f['later']:>14.2f}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print("wall s: the `tpbench sweep` command, start to exit (composing, launching, recording, printing)")
    print("experiment s: the runs' experiment functions on rank 0, summed")
    print("overhead s/run: (wall s - experiment s) / runs")
    print("first run s: from the command's start to the first run recorded, less its experiment")
    print("each later s: from the first run recorded to the last, less their experiments, per run")


if __name__ == "__main__":
    main()
