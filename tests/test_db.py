"""The results database on its own: what a run stores, how headlines are taken, what it refuses.

Every test that is not about SQLite's file runs twice: on a SQLite file and on a real PostgreSQL server
(the `db_url` fixture of conftest.py)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import multiprocessing
import re
import sqlite3
import threading
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from tpbench import machine
from tpbench.config import RunConfig, TrainConfig, config_hash
from tpbench.db import SCHEMA_VERSION, DatabaseRefused, NoDatabase, ResultsDB, _driver_url, schema
from tpbench.parallel.checks import resolve_switches
from tpbench.results import CommRow, Environment, Outcome, ParamRow, RankResult, Status
from tpbench.run import sweep

ENV = Environment("host", "cpu", "a cpu", 2, "gloo", "2.x", None, "abc", False)


def outcome(status: Status = Status.OK, seed: int = 0, env: Environment = ENV) -> Outcome:
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
    return Outcome(status, datetime(2026, 1, 1), ended, env, ranks if status is Status.OK else [], "", None)


def config(seed: int = 0) -> RunConfig:
    cfg = RunConfig()
    cfg.train.seed = seed
    cfg.launch.device, cfg.launch.backend = "cpu", "gloo"
    cfg.model.lean_rmsnorm = True  # as schema 6 ran it (the default then; auto is false without recompute)
    resolve_switches(cfg)  # train.compile and fused_optimizer=auto to what a CPU run records, as compose does
    return cfg


def test_a_run_is_stored_whole_and_headlines_aggregate_over_ranks(db_url):
    db = ResultsDB(db_url)
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


# config(0)'s identity as the code of schema 6 (commit a18794b) stored it
SCHEMA_6_HASH = "214010c7bd5ed45b"


@dataclasses.dataclass
class TrainWithANewField(TrainConfig):
    """The train section as a later change may make it: one more field, with its default."""

    new_knob: int = 0


def with_new_field(cfg: RunConfig, value: int = 0) -> RunConfig:
    cfg = copy.deepcopy(cfg)
    cfg.train = TrainWithANewField(**dataclasses.asdict(cfg.train), new_knob=value)
    return cfg


def test_a_new_config_field_at_its_default_keeps_a_runs_identity():
    assert config_hash(config()) == SCHEMA_6_HASH
    assert config_hash(with_new_field(config())) == SCHEMA_6_HASH
    assert config_hash(with_new_field(config(), 1)) != SCHEMA_6_HASH  # set: another experiment


def test_a_sweep_skips_what_an_older_database_has(db_url, monkeypatch):
    """A database written before a field was added (its run stored with the config and hash of then)
    still counts the run as done for the config with the new field at its default."""
    db = ResultsDB(db_url)
    old = db.record(config(), outcome())
    (stored_hash, hardware), *_ = db.finished()
    assert stored_hash == SCHEMA_6_HASH
    monkeypatch.setattr(sweep.machine, "here_key", lambda cfg: hardware)
    configs = [with_new_field(config()), with_new_field(config(), 1)]
    for c in configs:
        c.db.url = db_url  # the database is no part of the identity
    todo, done = sweep.split_done(configs, {db_url: db}, False)
    assert [r.run_id for r in done] == [old] and [c.train.new_knob for c in todo] == [1]


def test_finished_knows_only_ok_runs(db_url):
    db = ResultsDB(db_url)
    db.record(config(1), outcome(Status.FAILED))
    ok = db.record(config(2), outcome())
    assert list(db.finished().values()) == [ok]


def gpu(name: str, count: int = 8) -> Environment:
    return Environment("gpu-node", "cuda", name, count, "nccl", "2.x", "12.8", "abc", False)


H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def test_the_same_config_on_two_kinds_of_hardware_is_two_experiments(db_url):
    """One config, an H100 node and an A100 node: both OK runs are kept and both count as done, each for
    its own hardware, which names the GPU, GPUs per node and nodes."""
    db = ResultsDB(db_url)
    cfg = config()
    cfg.launch.device, cfg.launch.backend = "cuda", "nccl"
    on_h100 = db.record(cfg, outcome(env=gpu(H100)))
    on_a100 = db.record(cfg, outcome(env=gpu(A100)))
    cfg.launch.nnodes = "2"  # another config: nodes are in the hash too, and in the hardware
    two_nodes = db.record(cfg, outcome(env=gpu(A100, 4)))
    runs = db.runs()
    assert runs["hardware"].tolist() == [
        f"{H100} · 8 GPUs per node · 1 node",
        f"{A100} · 8 GPUs per node · 1 node",
        f"{A100} · 4 GPUs per node · 2 nodes",
    ]
    assert runs["config_hash"].nunique() == 2
    assert db.finished() == {
        (runs.at[0, "config_hash"], runs.at[0, "hardware"]): on_h100,
        (runs.at[1, "config_hash"], runs.at[1, "hardware"]): on_a100,
        (runs.at[2, "config_hash"], runs.at[2, "hardware"]): two_nodes,
    }
    assert db.runs(device="h100")["id"].tolist() == [on_h100]  # a substring, any case
    assert db.runs(device="A100-SXM4")["id"].tolist() == [on_a100, two_nodes]
    assert db.runs(device="%").empty and db.runs(device="_")["id"].tolist() == []  # no LIKE wildcards
    assert db.hardware_kinds() == sorted(runs["hardware"])


def test_emulated_ranks_are_hardware_of_their_own(db_url):
    db = ResultsDB(db_url)
    cfg = config()
    cfg.launch.device, cfg.launch.emulate = "cuda", "fake"
    db.record(
        cfg,
        outcome(env=Environment("h", "cuda", "H100 (emulated on a cpu)", 2, "fake", "2.x", None, None, None)),
    )
    cfg.launch.device, cfg.launch.emulate = "cpu", "real"
    db.record(cfg, outcome())
    assert db.runs()["hardware"].tolist() == [
        "H100 (emulated on a cpu) · 2 CPU cores per node · 1 node · ranks emulated",
        "a cpu · 2 CPU cores per node · 1 node · ranks emulated",
    ]


def test_sqlite_runs_in_wal_mode(tmp_path):
    ResultsDB(f"sqlite:///{tmp_path / 't.db'}")
    with sqlite3.connect(tmp_path / "t.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_sqlite_in_memory_opens_and_keeps_runs():
    # it asked for WAL, which a database in memory cannot take, forever: opened in a thread, to fail
    opened: list[ResultsDB] = []
    opening = threading.Thread(target=lambda: opened.append(ResultsDB("sqlite://")), daemon=True)
    opening.start()
    opening.join(timeout=30)
    assert opened, "ResultsDB('sqlite://') did not return"
    run_id = opened[0].record(config(), outcome())
    assert opened[0].runs()["id"].tolist() == [run_id] and opened[0].file is None


def test_reading_creates_nothing(tmp_path):
    with pytest.raises(NoDatabase):
        ResultsDB(f"sqlite:///{tmp_path / 'none.db'}", create=False)
    assert list(tmp_path.iterdir()) == []


def test_reading_a_blank_postgresql_database_creates_no_table(postgres):
    url = postgres.new_database()
    with pytest.raises(NoDatabase, match="has no runs yet"):
        ResultsDB(url, create=False)
    assert _tables(url) == {}


def _tables(url: str) -> dict[str, list[tuple]]:
    """Every table with all its rows: what "left untouched" compares."""
    engine = create_engine(_driver_url(url))
    try:
        with engine.connect() as conn:
            names = inspect(conn).get_table_names()
            return {n: sorted(map(tuple, conn.execute(text(f'SELECT * FROM "{n}"')).all())) for n in names}
    finally:
        engine.dispose()


def _snapshot(url: str) -> object:
    """A SQLite database by its folder's files, byte for byte; a PostgreSQL one by its tables' rows."""
    if url.startswith("sqlite"):
        folder = Path(url.removeprefix("sqlite:///")).parent
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
    return _tables(url)


def _foreign(url: str) -> None:
    engine = create_engine(_driver_url(url))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE photos (caption TEXT)"))
        conn.execute(text("INSERT INTO photos (caption) VALUES ('holiday')"))
    engine.dispose()


def _tpbench_of_version(version: int):
    def make(url: str) -> None:
        ResultsDB(url)
        engine = create_engine(_driver_url(url))
        with engine.begin() as conn:
            conn.execute(text("UPDATE meta SET value = :v WHERE key = 'schema_version'"), {"v": str(version)})
        if url.startswith("sqlite"):
            with engine.connect() as conn:  # one file, so that its digest says it all
                conn.exec_driver_sql("PRAGMA journal_mode = DELETE")
        engine.dispose()

    return make


REFUSED = {
    "foreign tables": (_foreign, "not a tpbench database (its tables: photos)"),
    "older schema without an upgrade": (_tpbench_of_version(1), "schema version 1, written by an older"),
    "newer schema": (
        _tpbench_of_version(SCHEMA_VERSION + 1),
        f"schema version {SCHEMA_VERSION + 1}, written by a newer",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=REFUSED)
def test_a_database_that_is_not_ours_is_refused_untouched(db_url, case):
    make, says = REFUSED[case]
    if db_url.startswith("sqlite"):
        Path(db_url.removeprefix("sqlite:///")).parent.mkdir()
    make(db_url)
    before = _snapshot(db_url)
    with pytest.raises(DatabaseRefused, match=re.escape(says)):
        ResultsDB(db_url)
    assert _snapshot(db_url) == before


def _version_2(url: str) -> None:
    """A version-2 database with one run (two comm rows): on SQLite the file tpbench f89ba7b wrote
    (its dump, tests/data/schema_v2.sql); on PostgreSQL the same tables made by this tpbench, less the
    columns versions 3, 4 and 5 added."""
    if url.startswith("sqlite"):
        path = Path(url.removeprefix("sqlite:///"))
        path.parent.mkdir()
        with sqlite3.connect(path) as conn:
            conn.executescript((Path(__file__).parent / "data" / "schema_v2.sql").read_text())
        conn.close()
        return
    db = ResultsDB(url)
    db.record(config(), outcome())
    db.engine.dispose()
    engine = create_engine(_driver_url(url))
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE comm DROP COLUMN exposed_s"))
        conn.execute(text("ALTER TABLE runs DROP COLUMN hardware"))
        for column in ("grad_ref_rel_l2", "param_max_abs", "param_rel_l2", "param_ref_rel_l2"):
            conn.execute(text(f"ALTER TABLE param_errors DROP COLUMN {column}"))
        conn.execute(text("UPDATE meta SET value = '2' WHERE key = 'schema_version'"))
    engine.dispose()


def _columns(url: str, table: str) -> list[str]:
    engine = create_engine(_driver_url(url))
    try:
        with engine.connect() as conn:
            return [c["name"] for c in inspect(conn).get_columns(table)]
    finally:
        engine.dispose()


def test_a_version_2_database_is_upgraded_in_place_keeping_its_rows(db_url):
    _version_2(db_url)
    assert "exposed_s" not in _columns(db_url, "comm")
    db = ResultsDB(db_url, create=False)
    assert _tables(db_url)["meta"] == [("app", "tpbench"), ("schema_version", str(SCHEMA_VERSION))]
    assert db.runs()[["status", "hardware"]].values.tolist() == [
        ["OK", "a cpu · 2 CPU cores per node · 1 node"]
    ]
    comm = db.comm()
    assert comm["bytes"].tolist() == [4096, 8192] and comm["exposed_s"].isna().all()
    run_id = db.record(config(7), outcome())  # and it takes the rows of this version
    assert db.comm([run_id])["bytes"].tolist() == [4096, 8192]
    assert len(db.runs()) == 2


def test_a_failed_upgrade_leaves_the_database_as_it_was(db_url, monkeypatch):
    """The second column of the upgrade fails (a column that exists): the first is rolled back with it."""
    _version_2(db_url)
    if db_url.startswith("sqlite"):
        with sqlite3.connect(db_url.removeprefix("sqlite:///")) as conn:
            conn.execute("PRAGMA journal_mode = DELETE")  # one file, so that its digest says it all
        conn.close()
    before = _snapshot(db_url)
    comm = schema.CommRow.__table__.c
    monkeypatch.setitem(schema.UPGRADES, 2, (comm.exposed_s, comm.count))
    with pytest.raises(
        DatabaseRefused, match=f"upgrading schema version 2 to {SCHEMA_VERSION} failed .*; left as"
    ):
        ResultsDB(db_url)
    assert _snapshot(db_url) == before
    assert "exposed_s" not in _columns(db_url, "comm")


DATA = Path(__file__).parent / "data"
# What the upgrade labels the four runs of tests/data/schema_v3*.sql with: the device name, device count,
# nodes and emulation each recorded (nodes and emulation in its config).
V3_HARDWARE = [
    "AMD EPYC 9B14 · 2 CPU cores per node · 1 node",
    "NVIDIA A100-SXM4-80GB · 8 GPUs per node · 2 nodes",
    "H100 (emulated on AMD EPYC 9B14) · 2 CPU cores per node · 1 node · ranks emulated",
    "AMD EPYC 9B14 · 2 CPU cores per node · 1 node",
]


def _version_3(url: str) -> None:
    """A version-3 database as tpbench 11c6f80 wrote it: four runs (three OK, on a CPU, on two nodes of
    A100s, on an H100 emulated on fake tensors; one FAILED). On SQLite the file (its dump,
    tests/data/schema_v3.sql), on PostgreSQL the database (its pg_dump, schema_v3_postgresql.sql)."""
    if url.startswith("sqlite"):
        path = Path(url.removeprefix("sqlite:///"))
        path.parent.mkdir()
        with sqlite3.connect(path) as conn:
            conn.executescript((DATA / "schema_v3.sql").read_text())
            conn.execute("PRAGMA journal_mode = DELETE")  # one file, so that its digest says it all
        conn.close()
        return
    import psycopg

    with psycopg.connect(url) as conn:
        conn.execute((DATA / "schema_v3_postgresql.sql").read_text())


def test_a_version_3_database_is_upgraded_in_place_labelling_every_run(db_url):
    _version_3(db_url)
    before = _tables(db_url)
    assert "hardware" not in _columns(db_url, "runs") and len(before["runs"]) == 4
    db = ResultsDB(db_url, create=False)
    after = _tables(db_url)
    assert after.pop("meta") == [("app", "tpbench"), ("schema_version", str(SCHEMA_VERSION))]
    assert [row[:-1] for row in after.pop("runs")] == before.pop("runs")  # each row as it was, + hardware
    # each row as it was, + version 5's four columns of the reference model's figures, empty
    assert [row[-4:] for row in after["param_errors"]] == [(None,) * 4] * len(after["param_errors"])
    after["param_errors"] = [row[:-4] for row in after["param_errors"]]
    assert after == {name: rows for name, rows in before.items() if name != "meta"}  # measurements, comm...
    runs = db.runs()
    assert runs["hardware"].tolist() == V3_HARDWARE
    assert runs["status"].tolist() == ["OK", "OK", "OK", "FAILED"]
    assert sorted(db.finished()) == sorted(zip(runs["config_hash"][:3], V3_HARDWARE[:3], strict=True))
    # the key a sweep on the CPU node checks before launching is the label its old run got
    cfg = config()
    assert machine.of_config(cfg, "AMD EPYC 9B14", 2) == V3_HARDWARE[0]
    assert db.runs(device="a100")["id"].tolist() == [2]


def test_a_failed_labelling_leaves_a_version_3_database_as_it_was(db_url, monkeypatch):
    """The labelling fails once the column is added and filled: both are rolled back."""
    _version_3(db_url)
    before = _snapshot(db_url)

    def label_then_fail(conn):
        schema._label_hardware(conn)
        conn.execute(text("UPDATE runs SET hardware = NULL WHERE nosuch = 1"))

    monkeypatch.setitem(schema.FILLS, 3, label_then_fail)
    with pytest.raises(
        DatabaseRefused, match=f"upgrading schema version 3 to {SCHEMA_VERSION} failed .*nosuch"
    ):
        ResultsDB(db_url)
    assert _snapshot(db_url) == before
    assert "hardware" not in _columns(db_url, "runs")


def test_a_file_that_is_not_sqlite_is_refused_untouched(tmp_path):
    path = tmp_path / "t.db"
    path.write_text("name,value\nx,1\n")
    with pytest.raises(DatabaseRefused, match="not even SQLite"):
        ResultsDB(f"sqlite:///{path}")
    assert path.read_text() == "name,value\nx,1\n" and list(tmp_path.iterdir()) == [path]


def _write_runs(url: str, seed: int) -> int:
    db = ResultsDB(url)
    for i in range(10):
        db.record(config(100 * seed + i), outcome(seed=seed))
    return seed


def test_four_writers_at_once_lose_nothing(db_url):
    """Four processes start on one blank database at once (the schema is created once) and each
    writes ten runs."""
    with multiprocessing.get_context("fork").Pool(4) as pool:
        assert sorted(pool.starmap(_write_runs, [(db_url, seed) for seed in range(4)])) == [0, 1, 2, 3]
    db = ResultsDB(db_url, create=False)
    assert len(db.runs()) == 40 and db.measurements()["run_id"].nunique() == 40
    assert len(db.measurements()) == 40 * 2 * 6
    if db_url.startswith("sqlite"):
        with sqlite3.connect(db_url.removeprefix("sqlite:///")) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_run_records_the_hardware_its_ranks_saw(tmp_path, monkeypatch):
    """The launching node's probe says one CPU; its ranks (here stood in for: nothing launches) say what
    they computed on, and that is what the run is recorded under. Ranks that saw different devices say
    so; a job whose ranks said nothing keeps the probe's."""
    from tpbench.run import launch

    names = {0: "Intel(R) Xeon(R) Platinum 8480+", 1: "Intel(R) Xeon(R) Platinum 8480+"}

    def ranks_say(cfg, job, on_progress):
        for rank, name in names.items():
            machine.write_rank_device(job, rank, name)

    monkeypatch.setattr(launch, "_launch", ranks_say)
    monkeypatch.setattr(launch, "_read_results", lambda cfg, folder: [RankResult(rank=0), RankResult(rank=1)])
    monkeypatch.setattr(machine, "here", lambda cfg: ("the launching node's CPU", 2))
    db, cfg = ResultsDB(f"sqlite:///{tmp_path / 't.db'}"), config()
    seen = []
    for said in (names, {0: "AMD EPYC 9B14", 1: "Intel(R) Xeon(R) Platinum 8480+"}, {}):
        names = said
        outcome = launch.run_job(cfg)
        seen.append(db.runs(ids=[db.record(cfg, outcome)])["hardware"].item())
        outcome.release()
    assert seen == [
        "Intel(R) Xeon(R) Platinum 8480+ · 2 CPU cores per node · 1 node",
        "AMD EPYC 9B14 + Intel(R) Xeon(R) Platinum 8480+ · 2 CPU cores per node · 1 node",
        "the launching node's CPU · 2 CPU cores per node · 1 node",
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "mode=tp_sp_vp",
            "dp=2",
            "dp_shard=full",
            "dtype=bfloat16",
            "precision=mixed",
            "recompute=selective",
        ],
        ["+preset=seed_check"],
        ["+preset=tron_memory", "launch.device=cuda", "launch.emulate=fake"],
        ["model=llama3_8b", "mode=dtensor_tp", "launch.device=cuda", "launch.emulate=fake"],
    ],
)
def test_a_stored_config_is_omegaconfs_container_of_it(overrides, monkeypatch):
    """What the database stores and hashes is the config as OmegaConf's to_container gives it, taken by
    dataclasses.asdict at 1/100 of its cost (config._as_data)."""
    import torch
    from omegaconf import OmegaConf

    from tpbench.config import public_config
    from tpbench.run.compose import expand

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for cfg in expand(overrides, launching=False):
        slow = OmegaConf.to_container(OmegaConf.structured(cfg))
        slow["db"]["url"] = public_config(cfg)["db"]["url"]
        assert public_config(cfg) == slow
