"""The results database on its own: what a run stores, how headlines are taken, what it refuses."""

from __future__ import annotations

import hashlib
import multiprocessing
import re
import sqlite3
from datetime import datetime
from pathlib import Path

import pytest

from tpbench.config import RunConfig
from tpbench.db import SCHEMA_VERSION, DatabaseRefused, NoDatabase, ResultsDB
from tpbench.launch import Environment, Outcome, Status
from tpbench.results import CommRow, ParamRow, RankResult

ENV = Environment("host", "cpu", "a cpu", 2, "gloo", "2.x", None, "abc", False)


def outcome(status: Status = Status.OK, seed: int = 0) -> Outcome:
    ranks = []
    for rank in (0, 1):
        result = RankResult(rank=rank, text="table of rank 0" if rank == 0 else "")
        result.add("grad_max_abs", 1e-8 * (rank + 1 + seed))
        result.add("passed", 1.0 - rank)  # rank 1 did not pass: the run did not
        result.add("peak_bytes", 1000 + rank, "B")
        for step in range(3):
            result.add("adamw_logits_max_abs", step * 1e-6, step=step)
        result.params = [ParamRow("model.norm.weight", "replicated", [64], 1e-9, 2e-9, 3e-7)]
        result.comm = [CommRow("all_reduce", "activation", 8, 4096 * (rank + 1))]
        ranks.append(result)
    ended = datetime(2026, 1, 1, 0, 0, 5)
    return Outcome(status, datetime(2026, 1, 1), ended, ENV, ranks if status is Status.OK else [], "", None)


def config(seed: int = 0) -> RunConfig:
    cfg = RunConfig()
    cfg.train.seed = seed
    cfg.launch.device, cfg.launch.backend = "cpu", "gloo"
    return cfg


def test_a_run_is_stored_whole_and_headlines_aggregate_over_ranks(tmp_path):
    db = ResultsDB(f"sqlite:///{tmp_path / 'runs' / 't.db'}")
    run_id = db.record(config(), outcome())
    runs = db.runs()
    assert runs[["id", "status", "mode", "tp", "dp", "layers", "backend", "git_commit"]].values.tolist() == [
        [run_id, "OK", "tp", 2, 1, 2, "gloo", "abc"]
    ]
    long = db.measurements([run_id])
    assert len(long) == 2 * (3 + 3) and set(long["rank"]) == {0, 1}
    metrics = db.metrics()
    assert metrics.at[run_id, "grad_max_abs"] == pytest.approx(2e-8)  # max over ranks
    assert metrics.at[run_id, "passed"] == 0.0  # min over ranks
    assert "adamw_logits_max_abs" not in metrics.columns  # a curve is no headline
    assert db.param_errors()["shape"].tolist() == ["[64]", "[64]"]
    assert db.comm()["bytes"].tolist() == [4096, 8192]
    record = db.run_record(run_id)
    assert record["metrics"]["peak_bytes"] == 1001 and record["config"]["train"]["seed"] == 0
    assert db.text(run_id) == "table of rank 0"


def test_finished_knows_only_ok_runs(tmp_path):
    db = ResultsDB(f"sqlite:///{tmp_path / 't.db'}")
    db.record(config(1), outcome(Status.FAILED))
    ok = db.record(config(2), outcome())
    assert list(db.finished().values()) == [ok]


def test_sqlite_runs_in_wal_mode(tmp_path):
    ResultsDB(f"sqlite:///{tmp_path / 't.db'}")
    with sqlite3.connect(tmp_path / "t.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_reading_creates_nothing(tmp_path):
    with pytest.raises(NoDatabase):
        ResultsDB(f"sqlite:///{tmp_path / 'none.db'}", create=False)
    assert list(tmp_path.iterdir()) == []


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _foreign_sqlite(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, caption TEXT)")
        conn.execute("INSERT INTO photos (caption) VALUES ('holiday')")


def _tpbench_of_version(version: int):
    def make(path: Path) -> None:
        ResultsDB(f"sqlite:///{path}")
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
            conn.commit()
            conn.execute("PRAGMA journal_mode = DELETE")  # one file, so that its digest says it all

    return make


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda path: path.write_text("name,value\nx,1\n"), "not even SQLite"),
        (_foreign_sqlite, "not a tpbench database (its tables: photos)"),
        (_tpbench_of_version(0), "schema version 0, written by an older tpbench"),
        (_tpbench_of_version(SCHEMA_VERSION + 1), f"schema version {SCHEMA_VERSION + 1}, written by a newer"),
    ],
    ids=["text file", "foreign sqlite", "older schema", "newer schema"],
)
def test_a_file_that_is_not_ours_is_refused_untouched(tmp_path, make, says):
    path = tmp_path / "t.db"
    make(path)
    before, files = _digest(path), sorted(tmp_path.iterdir())
    with pytest.raises(DatabaseRefused, match=re.escape(says)):
        ResultsDB(f"sqlite:///{path}")
    assert _digest(path) == before and sorted(tmp_path.iterdir()) == files


def _write_runs(url: str, seed: int) -> int:
    db = ResultsDB(url)
    for i in range(10):
        db.record(config(100 * seed + i), outcome(seed=seed))
    return seed


def test_four_writers_at_once_lose_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        assert sorted(pool.starmap(_write_runs, [(url, seed) for seed in range(4)])) == [0, 1, 2, 3]
    db = ResultsDB(url, create=False)
    assert len(db.runs()) == 40 and db.measurements()["run_id"].nunique() == 40
    with sqlite3.connect(tmp_path / "t.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
