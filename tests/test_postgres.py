"""The results database on a real PostgreSQL server, through the real `tpbench` command: four sweeps
writing at once, the same report as SQLite, a password that never shows, and a missing driver.

The server is the session's (conftest.py `postgres`); its URLs carry a password (scram-sha-256).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import FAST, PG_PASSWORD, Workdir
from sqlalchemy import create_engine, insert, select
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.db import Base, Meta, ResultsDB, _driver_url

SEEDS = range(4)


@pytest.fixture(scope="module")
def pg(postgres, tmp_path_factory) -> tuple[Workdir, str, list, object]:
    """Four sweeps at once into one blank PostgreSQL database, then one run that fails on purpose
    (its job folder, config and logs are kept)."""
    work = Workdir(tmp_path_factory.mktemp("pg"))
    url = postgres.new_database()
    clis = [work.start("sweep", *FAST, "tp=1", f"train.seed={seed}", f"db.url={url}") for seed in SEEDS]
    sweeps = [(cli, *cli.communicate(timeout=600)) for cli in clis]
    failed = work.run("run", *FAST, "+fault=raise_on_rank1", f"db.url={url}")
    return work, url, sweeps, failed


def test_four_sweeps_share_one_postgresql_database(pg):
    _, url, sweeps, _ = pg
    for cli, _, stderr in sweeps:
        assert cli.returncode == 0, stderr
    db = ResultsDB(url, create=False)
    runs = db.runs(status="OK")
    assert sorted(db.run_record(i)["config"]["train"]["seed"] for i in runs["id"]) == list(SEEDS)
    assert db.measurements(runs["id"].tolist())["run_id"].nunique() == 4
    assert set(db.metrics(runs["id"].tolist())["passed"]) == {1.0}


def test_a_password_never_shows_in_what_tpbench_stores_logs_or_prints(pg, tmp_path):
    work, url, sweeps, failed = pg
    assert failed.returncode == 1 and "RuntimeError: injected fault raise_on_rank1" in failed.stderr
    said = [failed.stdout, failed.stderr, *(out + err for _, out, err in sweeps)]
    # The job folder of the failed run: its config.yaml, launcher log, per-rank logs and error files.
    (job,) = [p for p in work.jobs.iterdir() if (p / "config.yaml").exists()]
    kept = [p.read_text(errors="replace") for p in job.rglob("*") if p.is_file()]
    assert "postgresql://tpbench:***@" in (job / "config.yaml").read_text()
    # Every row of every table of the database.
    engine = create_engine(_driver_url(url))
    with engine.connect() as conn:
        rows = [repr(row) for table in Base.metadata.sorted_tables for row in conn.execute(select(table))]
    engine.dispose()
    assert rows and not any(PG_PASSWORD in row for row in rows)  # every row, none with the password
    shown = [
        work.invoke("runs", "--db", url).stdout,
        work.invoke("runs", "show", "5", "--json", "--db", url).stdout,
        work.invoke("run", "--cfg", f"db.url={url}").stdout,
    ]
    reports = []
    for fmt in ("html", "md", "json", "csv"):
        done = work.invoke("report", "--db", url, "--format", fmt, "--out", str(tmp_path / f"r.{fmt}"))
        assert done.exit_code == 0, done.output
        reports.append((tmp_path / f"r.{fmt}").read_text())
    texts = said + kept + rows + shown + reports
    assert len(kept) >= 4 and len(rows) > 100
    assert not [t for t in texts if PG_PASSWORD in t]


def test_the_report_is_the_same_as_from_sqlite(pg, tmp_path):
    """The runs of the PostgreSQL database copied, row for row, into a SQLite file: the same report."""
    _, url, _, _ = pg
    sqlite_url = f"sqlite:///{tmp_path / 'copy.db'}"
    ResultsDB(sqlite_url)
    source, copy = create_engine(_driver_url(url)), create_engine(sqlite_url)
    with source.connect() as src, copy.begin() as dst:
        for table in Base.metadata.sorted_tables:
            rows = [row._asdict() for row in src.execute(select(table))]
            if table is not Meta.__table__ and rows:
                dst.execute(insert(table), rows)
    source.dispose()
    copy.dispose()
    reports = {}
    for name, db in (("pg", url), ("sqlite", sqlite_url)):
        for fmt in ("md", "json", "csv"):
            out = tmp_path / name / f"report.{fmt}"
            done = CliRunner().invoke(app, ["report", "--db", db, "--format", fmt, "--out", str(out)])
            assert done.exit_code == 0, done.output
        folder = tmp_path / name
        md = (folder / "report.md").read_text()  # the database's own row names it: the one difference
        md = re.sub(r"^\| database \| .* \|$", "| database | DB |", md, flags=re.MULTILINE)
        reports[name] = (
            re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", "TIME", md),
            json.loads((folder / "report.json").read_text()),
            (folder / "report.csv").read_text(),
            sorted(p.name for p in folder.glob("*.png")),
        )
    # every run of the database: the four sweeps' and the one that failed on purpose
    assert sorted(run["status"] for run in reports["pg"][1]) == ["FAILED", "OK", "OK", "OK", "OK"]
    assert reports["pg"] == reports["sqlite"]


COMMANDS_WITHOUT_DRIVER = {
    "run": ["run", "kind=validate", "db.url=postgresql://me:hunter2@db.example/tpbench"],
    "sweep": ["sweep", "kind=validate", "db.url=postgresql://me:hunter2@db.example/tpbench"],
    "report": ["report", "--db", "postgresql://me:hunter2@db.example/tpbench"],
    "runs": ["runs", "--db", "postgresql://me:hunter2@db.example/tpbench"],
}


@pytest.mark.parametrize("args", COMMANDS_WITHOUT_DRIVER.values(), ids=COMMANDS_WITHOUT_DRIVER)
def test_without_the_driver_a_postgresql_url_says_what_to_install(args, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if psycopg were not installed
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "db.url='postgresql://me:***@db.example/tpbench' needs the psycopg driver, which is not installed: "
        "pip install 'tpbench[postgres]'"
    ]
    assert list(Path(tmp_path).iterdir()) == []
