"""The one-node cluster session of docs/clusters.md: start the tests' one-node Slurm cluster and a
PostgreSQL server (tests/slurm_cluster.py, tests/conftest.py), run the section's commands in a fresh
folder, print them.

    .venv/bin/python scripts/cluster_demo.py        # as root, after `bash scripts/setup.sh --tests`
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import PG_PASSWORD, PostgresServer, _postgres_bindir  # noqa: E402
from slurm_cluster import OneNodeCluster  # noqa: E402


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="tpbench-cluster-demo-"))
    cluster = OneNodeCluster(Path(tempfile.mkdtemp(prefix="tpbench-slurm-")))
    pg_dir = Path(tempfile.mkdtemp(prefix="tpbench-pg-"))
    postgres = pwd.getpwnam("postgres")
    os.chown(pg_dir, postgres.pw_uid, postgres.pw_gid)
    server = PostgresServer(_postgres_bindir(), pg_dir, ["runuser", "-u", "postgres", "--"])
    path = f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"
    env = dict(cluster.env, OMP_NUM_THREADS="1", COLUMNS="160", PATH=path, PW=PG_PASSWORD)

    def sh(command: str, background: bool = False) -> subprocess.Popen:
        print(f"$ {command.replace(PG_PASSWORD, '$PW')}{' &' if background else ''}", flush=True)
        process = subprocess.Popen(command, shell=True, cwd=work, env=env, stderr=subprocess.STDOUT)
        if not background:
            process.wait()
        return process

    try:
        cluster.start()
        server.start()
        import psycopg

        with psycopg.connect(server.url("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE results")
        url = server.url("results")
        common = f"launcher=slurm launch.slurm.time_min=10 db.url={url}"
        sweep = f"tpbench sweep kind=validate validate.steps=5 mode=tp,tp_sp,tp_sp_vp {common}"
        sh(sweep)
        sh(f"tpbench runs --db {url}")
        cancelled = sh(f"tpbench run kind=validate validate.steps=1000000 {common}", background=True)
        squeue = ["squeue", "-h", "-o", "%i %t"]
        deadline = time.monotonic() + 300
        while " R" not in subprocess.run(squeue, env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(1)
        time.sleep(10)
        sh("squeue")
        job = subprocess.run(squeue, env=env, capture_output=True, text=True).stdout.split()[0]
        sh(f"scancel {job}")
        cancelled.wait()
        print(f"# exit code {cancelled.returncode}", flush=True)
        sh(f"tpbench report --db {url} --format md --out cluster.md")
        sh(f"{sweep} --wait")
    finally:
        cluster.stop()
        server.stop()


if __name__ == "__main__":
    main()
