"""The CPU cost of the tests' compiled configs: test_parallel's COMPILED validations, alone in one 2-rank
torchrun job (tests/torchrun_checks.py's validate suite), with inductor's cache in a given folder.

    .venv/bin/python scripts/compile-cost.py CACHE_DIR [NAME=VALUE ...]   (extra environment variables)

An empty CACHE_DIR measures a cold cache (a fresh CI machine), the same folder again a warm one. Prints
the job's wall, user and sys seconds (the launcher, both ranks and any compile workers) and each
config's CPU seconds per rank (its rank's process time alone).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
from test_parallel import COMPILED, VALIDATE_T2  # noqa: E402 (tests/ on the path first)
from torchrun_checks import CHECKS, TINY  # noqa: E402


def main() -> None:
    cache, extra = sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:])
    checks = {name: [*TINY, *VALIDATE_T2[name]] for name in COMPILED}
    env = dict(os.environ, OMP_NUM_THREADS="1", TPBENCH_CHECKS=json.dumps(checks), **extra)
    env["TORCHINDUCTOR_CACHE_DIR"] = cache
    out = Path(tempfile.mkdtemp()) / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([*cmd, str(CHECKS), str(out), "validate"], env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(done.stderr[-4000:])
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    print(
        f"{time.monotonic() - start:.1f} s wall, {user:.1f} user, {system:.1f} sys: {user + system:.1f} CPU s"
    )
    ranks = json.loads(out.read_text())
    for name in COMPILED:
        print(f"  {name}: " + ", ".join(f"{rank[name]['cpu_s']:.1f}" for rank in ranks) + " CPU s per rank")


if __name__ == "__main__":
    main()
