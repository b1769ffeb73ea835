"""Shared by the runner tests: the real `tpbench` command in a folder of its own, and what to check after."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner, Result

from tpbench.cli import app

TPBENCH = str(Path(sys.executable).with_name("tpbench"))
# The tiny model, a couple of AdamW steps: a launch costs seconds.
FAST = ["kind=validate", "validate.steps=2", "validate.every=1"]


@dataclass
class Workdir:
    """A working folder: runs/tpbench.db lands in it and job folders in its jobs/ (TMPDIR)."""

    path: Path

    @property
    def db(self) -> Path:
        return self.path / "runs" / "tpbench.db"

    @property
    def jobs(self) -> Path:
        return self.path / "jobs"

    def env(self) -> dict[str, str]:
        self.jobs.mkdir(exist_ok=True)
        return dict(os.environ, TMPDIR=str(self.jobs), OMP_NUM_THREADS="1", COLUMNS="200")

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [TPBENCH, *args],
            cwd=self.path,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [TPBENCH, *args], cwd=self.path, env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def invoke(self, *args: str) -> Result:
        """The CLI in this process, for commands that launch nothing: no interpreter to start."""
        saved, tempfile.tempdir = tempfile.tempdir, str(self.jobs)
        try:
            with contextlib.chdir(self.path):
                return CliRunner().invoke(app, list(args))
        finally:
            tempfile.tempdir = saved

    def live_workers(self) -> list[int]:
        """Pids of tpbench workers still running from this folder's jobs."""
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"tpbench.worker" in cmdline and str(self.jobs).encode() in cmdline:
                pids.append(int(proc.name))
        return pids

    def integrity(self) -> str:
        with sqlite3.connect(self.db) as conn:
            return conn.execute("PRAGMA integrity_check").fetchone()[0]

    def query(self, sql: str, *params: object) -> list[tuple]:
        with sqlite3.connect(self.db) as conn:
            return conn.execute(sql, params).fetchall()
