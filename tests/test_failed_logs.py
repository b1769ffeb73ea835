"""A failed run's job folder (its config, logs, error files, rank results) is kept beside the database,
as runs/logs/RUN_ID/ next to the SQLite file or in db.logs, and `runs show` names it (issue 35): so
that it survives a reboot and travels with the results. In one process, with job folders made here;
tests/test_runner.py sees it from real failed runs."""

from __future__ import annotations

from pathlib import Path

from test_db import config, outcome
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.db import ResultsDB
from tpbench.results import Status
from tpbench.run import sweep


def _failed_job(tmp: Path) -> object:
    job = tmp / "tmp" / "tpbench-job-abc"
    (job / "logs" / "0").mkdir(parents=True)
    (job / "logs" / "0" / "stderr.log").write_text("RuntimeError: on purpose\n")
    failed = outcome(Status.FAILED)
    failed.error, failed.failed_rank, failed.job, failed.log_dir = (
        "RuntimeError: on purpose",
        1,
        job,
        str(job),
    )
    return failed


def test_a_failed_run_keeps_its_logs_beside_the_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path}/results/t.db"
    failed = _failed_job(tmp_path)
    said: list[str] = []
    ran = sweep.record(config(), ResultsDB(url), failed, said.append)
    kept = tmp_path / "results" / "logs" / str(ran.run_id)
    assert (kept / "logs" / "0" / "stderr.log").read_text() == "RuntimeError: on purpose\n"
    assert not (tmp_path / "tmp" / "tpbench-job-abc").exists()  # moved, not copied
    assert ResultsDB(url).run_record(ran.run_id)["log_dir"] == str(kept)
    assert said == [f"run {ran.run_id} FAILED: RuntimeError: on purpose (logs: {kept})"]
    shown = CliRunner().invoke(app, ["runs", "show", str(ran.run_id), "--db", url])
    assert f"run {ran.run_id} FAILED: RuntimeError: on purpose; its logs: {kept}" in shown.stderr


def test_db_logs_names_the_folder_and_an_ok_run_keeps_none(tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    cfg = config()
    cfg.db.logs = str(tmp_path / "kept")
    run_id = ResultsDB(url).record(cfg, _failed_job(tmp_path))
    assert (tmp_path / "kept" / str(run_id) / "logs").is_dir()
    ok = outcome()
    ok.job = tmp_path / "tpbench-job-ok"
    ok.job.mkdir()
    ok_id = ResultsDB(url).record(config(), ok)
    assert ResultsDB(url).run_record(ok_id)["log_dir"] is None and not (tmp_path / "logs").exists()


def test_without_a_file_or_db_logs_the_job_folder_stays(tmp_path):
    """A database on a server has no file to put the logs beside: without db.logs they stay."""
    failed = _failed_job(tmp_path)
    db = ResultsDB(f"sqlite:///{tmp_path}/t.db")
    db.file = None  # as PostgreSQL's (tests/test_postgres.py needs a server)
    run_id = db.record(config(), failed)
    assert db.run_record(run_id)["log_dir"] == str(tmp_path / "tmp" / "tpbench-job-abc")
    assert (tmp_path / "tmp" / "tpbench-job-abc" / "logs").is_dir()
