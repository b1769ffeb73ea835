"""Shared by the runner tests: the real `tpbench` command in a folder of its own, and what to check after."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import pwd
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from beside import BESIDE, under_xdist
from ci_skips import (  # noqa: F401 (hooks: under CI a skip for a missing part fails)
    pytest_configure,
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)
from slurm_cluster import OneNodeCluster, why_not
from typer.testing import CliRunner, Result

from tpbench.cli import app

# Inductor compiles in each rank's own process, not in a pool of worker processes that each import torch:
# the pool adds CPU (the compiled configs' launch with an empty cache: 239 CPU s, 293 with the pool; the
# same with a warm one: docs/development.md#the-budget, scripts/compile-cost.py).
# Every torchrun job and `tpbench` process of the tests inherits it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The rates the tests probe (tpbench.predict.rate_probe), under the suite's own load, go to a cache of
# their own, kept between runs as the developer's is: the developer's later runs and
# benchmarks/time_model_grid.py read rates probed on a machine they had to themselves, not these.
os.environ.setdefault("TPBENCH_CACHE_DIR", str(Path.home() / ".cache" / "tpbench-tests"))

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
            if b"tpbench.run.worker" in cmdline and str(self.jobs).encode() in cmdline:
                pids.append(int(proc.name))
        return pids

    def integrity(self) -> str:
        with sqlite3.connect(self.db) as conn:
            return conn.execute("PRAGMA integrity_check").fetchone()[0]

    def query(self, sql: str, *params: object) -> list[tuple]:
        with sqlite3.connect(self.db) as conn:
            return conn.execute(sql, params).fetchall()


# -- The quick tier: `pytest -m quick`, the loop for an edit (docs/development.md) --------------------

# Not quick: what waits on a torchrun job (every job beside the tests) or on a server, and the files
# whose tests each launch `tpbench` (sweeps, faults, Slurm, PostgreSQL, the fake-CUDA job), bar the one
# launch the tier keeps: a default `tpbench run`, end to end (runner, worker, every kind, the database).
SLOW_FIXTURES = {"postgres", "slurm", "checked", "html_report", "ran_with_progress", "machines"}
SLOW_FILES = {"test_runner.py", "test_warm.py", "test_slurm.py", "test_postgres.py", "test_cuda_path.py",
              "test_setup.py"}  # fmt: skip
QUICK_LAUNCHES = {
    "test_runner.py::test_the_default_run_is_the_tiny_model_with_every_kind",
    "test_inner_loop.py::test_one_launch_validates_tp_sp_vp_dp2_and_catches_a_planted_bug",
}
SLOW_TESTS = {  # a few seconds or more each (`--durations` on the files), covered in the full suite
    "test_depth.py::test_measured_peaks_are_the_split_line_in_every_mode_and_approach_the_limit",
    "test_depth.py::test_measured_slopes_at_two_t_give_the_split_a_and_r",
    "test_depth.py::test_the_report_fits_each_mode_over_depth_beside_the_split_and_the_seed",
    "test_db.py::test_four_writers_at_once_lose_nothing",
    "test_diagram.py::test_browser_renders_the_diagram_without_overlapping_labels",
    "test_diagram.py::test_browser_overlap_probe_can_fail",
    "test_report.py::test_browser_checks_catch_errors_and_blank_charts",
    "test_report.py::test_markdown_has_the_tables_and_png_charts_beside_it",
    "test_report.py::test_filters_select_runs",
    "test_compile.py::test_compiled_dropout_draws_eagers_masks_and_never_recompiles",  # 17 s warm, 22 cold
    "test_compile.py::test_aot_eager_compiles_the_blocks_without_inductor",  # 1.9 s
    "test_compose_cache.py::test_the_cached_compose_is_hydras_whole_compose",  # 14 cases, 2.4 s
    "test_fit.py::test_json_has_every_row_and_the_assumptions",  # 3.4 s
    "test_compile.py::test_a_runs_workers_inherit_tpbenchs_inductor_cache",  # a process importing torch, 12 s
}


def quick(item: pytest.Item) -> bool:
    path, name = item.nodeid.split("/")[-1], item.nodeid.split("::")[-1].split("[")[0]
    file = path.split("::")[0]
    if f"{file}::{name}" in QUICK_LAUNCHES:
        return True
    if item.get_closest_marker("not_quick"):  # a case its file marks slow (test_documented_commands)
        return False
    on_postgres = getattr(item, "callspec", None) and item.callspec.params.get("db_url") == "postgresql"
    if file in SLOW_FILES or f"{file}::{name}" in SLOW_TESTS or on_postgres:
        return False
    needs = set(getattr(item, "fixturenames", ()))
    return not needs & SLOW_FIXTURES and not any(BESIDE.needs(item, n) for n in needs)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if quick(item):
            item.add_marker(pytest.mark.quick)
    # The files whose tests wait on a computing job beside them run last, each file whole (its module
    # fixtures made once), in their order: the jobs compute while the other files' tests run, instead
    # of this process waiting on the first job from the suite's first file on (test_accumulation: 306 s
    # of its 727 s, one core idle for most of the rest; docs/development.md#the-budget). A file whose
    # jobs only wait (test_runner's fault sweeps, in a lane of their own) runs early: its own waits
    # (timeouts, a Ctrl-C's grace) then leave the cores to the computing jobs.
    waiting = {
        item.path for item in items if any(BESIDE.lane(item, n) == "computes" for n in item.fixturenames)
    }
    items.sort(key=lambda item: item.path in waiting)


# -- Jobs beside the tests (tests/beside.py) ----------------------------------------------------------


def pytest_collection_finish(session: pytest.Session) -> None:
    BESIDE.tmp = session.config._tmp_path_factory  # the tmp_path_factory fixture's own
    keep_selected(session.items)
    if not session.config.option.collectonly:
        BESIDE.start_for(session.items)


def keep_selected(items: list[pytest.Item]) -> None:
    """The shared torchrun jobs (tests/torchrun_checks.py `Shared`) run the configs the selected tests
    need, not every config their modules added: `pytest -k NAME` runs NAME's config alone. A config is
    kept where a selected test that reads a job (its own module's or one it imports) names it among its
    parameters, or names none of that module's configs (it may read them all)."""
    checks = sys.modules.get("torchrun_checks")
    if checks is None:  # no test module imported it: no shared job
        return
    readers: dict[str, list[set[str]]] = {}  # module -> the parameters of each selected test reading a job
    for item in items:
        jobs = {key.split("::")[0] for name in item.fixturenames if (key := BESIDE.key(item, name))}
        if not jobs:
            continue
        callspec = getattr(item, "callspec", None)
        params = {str(v) for v in callspec.params.values()} if callspec else set()
        for module in jobs | {item.module.__name__}:
            readers.setdefault(module, []).append(params)
    shared = tuple(checks.Shared.ALL)

    def keep(module: str, name: str) -> bool:
        names = set().union(*(s.names(module) for s in shared))
        return any(name in params or not params & names for params in readers.get(module, []))

    for world in shared:
        world.select(keep)
    # What the imports and the collection made lives for the session: out of the cycle collector's way,
    # memory.run's gc.collect (the in-process emulated ranks) scans only what the tests made (0.3 s -> ms)
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    BESIDE.shutdown()


ONCE_PER_SESSION = (
    "%s: one server for the session, which under pytest-xdist (-n) each worker would start again: "
    "accepted are -n with -m quick, or no -n"
)


# -- PostgreSQL: one real server for the session, a fresh database per test ---------------------------

PG_PASSWORD = "s3cret-pg-Pa55"  # must never show up in what tpbench stores, logs or prints


class PostgresServer:
    """Debian's PostgreSQL in a temp folder: initdb, then pg_ctl on a free port of 127.0.0.1, password
    authentication over TCP. As root it runs as the `postgres` user (PostgreSQL refuses root)."""

    def __init__(self, bindir: Path, folder: Path, as_user: list[str]):
        self.bindir, self.folder, self.as_user = bindir, folder, as_user
        self.data, self.port, self.count = folder / "data", _free_port(), 0

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.as_user, str(self.bindir / tool), *args], check=True, capture_output=True, timeout=60
        )

    def start(self) -> None:
        (self.folder / "pw").write_text(PG_PASSWORD)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "tpbench",
            "--pwfile",
            str(self.folder / "pw"),
            "--auth-host=scram-sha-256",
            "--auth-local=trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.folder / "log"), "-w", "start"
        )

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, database: str, password: bool = True) -> str:
        secret = f":{PG_PASSWORD}" if password else ""
        return f"postgresql://tpbench{secret}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A blank database; its URL."""
        import psycopg

        self.count += 1
        name = f"t{self.count}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _postgres_bindir() -> Path | None:
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


@pytest.fixture(scope="session")
def postgres(tmp_path_factory) -> Iterator[PostgresServer]:
    """Skipped, with the reason, only where this machine cannot run PostgreSQL (under CI: failed,
    ci_skips.py)."""
    if under_xdist():
        pytest.fail(ONCE_PER_SESSION % "PostgreSQL")
    bindir = _postgres_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (no pg_ctl): `bash scripts/setup.sh --tests` installs it")
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("psycopg is not installed: `pip install -e '.[test]'` installs it")
    folder = Path(tempfile.mkdtemp(prefix="tpbench-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` user to run PostgreSQL as")
        os.chown(folder, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    server = PostgresServer(bindir, folder, as_user)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """A blank results database: a SQLite file, or a database on the session's PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'runs' / 't.db'}"
    return request.getfixturevalue("postgres").new_database()


# -- Slurm: one real one-node cluster for the session (tests/slurm_cluster.py) ------------------------


@pytest.fixture(scope="session")
def slurm() -> Iterator[OneNodeCluster]:
    """Skipped, with the reason, only where this machine cannot run Slurm (under CI: failed, ci_skips.py)."""
    if under_xdist():
        pytest.fail(ONCE_PER_SESSION % "Slurm")
    reason = why_not()
    if reason:
        pytest.skip(reason)
    cluster = OneNodeCluster(Path(tempfile.mkdtemp(prefix="tpbench-slurm-")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.dir, ignore_errors=True)
