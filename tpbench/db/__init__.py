"""The results database: every run, its measurements, per-parameter errors and collectives.

SQLAlchemy 2.0 over SQLite (runs/tpbench.db by default) or PostgreSQL (psycopg 3, the `postgres` extra).
Only the parent process writes, one transaction per run. SQLite runs in WAL mode with a busy timeout and
takes its write lock up front (BEGIN IMMEDIATE), so several sweeps can share one file; on PostgreSQL the
schema is created under an advisory lock, so several sweeps can start on one blank database. A `meta`
table names the schema version: an older version with an upgrade (`UPGRADES`) is upgraded in place, in
the one transaction that checks it (a failure leaves it as it was); a newer one, an older one without an
upgrade, or a file that is not a tpbench database is refused untouched. A password in a URL is never
shown or stored (`hide_password`).

A run's identity is its config and its hardware: `config_hash` (tpbench.config: what the config
measures, nothing of the machine) and `hardware` (tpbench.machine.key), one readable line of
  - the device name: device=cuda the GPU model (torch.cuda.get_device_name), device=cpu the CPU model
    (/proc/cpuinfo's model name, else platform), and for a GPU emulated on fake tensors
    (launch.device=cuda launch.emulate=fake) the emulated GPU, launch.emulate_gpu, "H100 (emulated on
    <CPU model>)";
  - the devices per node: GPUs (torch.cuda.device_count), else CPU cores (os.cpu_count);
  - the nodes (launch.nnodes, as the job ran: under Slurm, its node count);
  - whether its ranks were emulated (launch.emulate real or fake; tpbench.parallel.emulation).
So one database keeps the same sweep on two kinds of machine apart: `finished()` (what a sweep skips)
and the report's "latest" are per (config hash, hardware). The key a sweep checks before launching is
this node's, probed on it (tpbench.machine.here); the row records what the ranks themselves saw (each
worker writes its device's name into the job folder; the node that records the run reads its ranks'),
which differs from the probe only where the ranks' devices do. Under launcher=slurm the job runs on
nodes the submitting host cannot see, so the hardware is the job's own: each job probes its node and
runs nothing when its config has an OK run on that hardware; the submitting host skips, without a job,
only the configs whose last job of the same Slurm request (partition, GPUs per node, sbatch lines)
recorded an OK run (tpbench.run.slurm). Version 4 added the column; the upgrade labels every older row from
the device name, device count and config it recorded.

The tables, the schema version and the upgrades are in tpbench.db.schema; this module opens, checks,
writes and reads. Reading returns pandas DataFrames: `runs()`, `measurements()`, `metrics()` (one
headline value per run and metric), `param_errors()`, `comm()`; `run_record()` is one run as a
JSON-ready dict.
"""

from __future__ import annotations

import json
import math
import shutil
import sqlite3
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    and_,
    create_engine,
    event,
    func,
    insert,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from tpbench import machine
from tpbench.config import RunConfig, config_hash, hide_password, mode_label, public_config, world_size
from tpbench.db.schema import (
    FILLS,
    SCHEMA_VERSION,
    UPGRADES,
    Base,
    CommRow,
    MeasurementRow,
    Meta,
    ParamErrorRow,
    Run,
)
from tpbench.db.urls import DRIVERS
from tpbench.db.urls import driver_missing as driver_missing
from tpbench.db.urls import parse_since as parse_since
from tpbench.db.urls import url_refused as url_refused
from tpbench.results import RANK_AGGREGATION

if TYPE_CHECKING:
    import pandas as pd  # imported by the queries that make frames: `tpbench plan` never loads it

    from tpbench.results import Outcome

APP = "tpbench"
BUSY_TIMEOUT_S = 60
SQLITE_HEADER = b"SQLite format 3\x00"
# Serializes the schema check and creation of sweeps starting at once on one PostgreSQL database.
PG_SCHEMA_LOCK = 0x7470626E  # "tpbn"


def headline_metrics(rows: Iterable[tuple[str, float | None]]) -> dict[str, float]:
    """One run's headline metrics from its (name, value) measurements of no step, every rank's: per
    name the max over ranks, or the aggregation tpbench.results.RANK_AGGREGATION names (min), missing
    values left out, by name; what `metrics` gives for one run, without loading pandas (`tpbench run`
    prints one run: pandas costs its CLI about 0.3 s)."""
    values: dict[str, list[float]] = {}
    for name, value in rows:
        if value is not None and not math.isnan(value):
            values.setdefault(name, []).append(value)
    aggregate = {"max": max, "min": min}
    return {name: aggregate[RANK_AGGREGATION.get(name, "max")](values[name]) for name in sorted(values)}


class DatabaseRefused(Exception):
    """The URL points at something tpbench must not write to; one line says why."""


class ResultsDB:
    """One results database. `create=False` opens only what exists (NoDatabase otherwise)."""

    def __init__(self, url: str, create: bool = True):
        self.url = hide_password(url)  # what messages and reports show
        missing = driver_missing(url)
        if missing:
            raise DatabaseRefused(missing)
        try:
            parsed = make_url(url)
            _driver_url(url).get_dialect().import_dbapi()  # the driver is installed
        except (ArgumentError, NoSuchModuleError, ImportError, ValueError) as e:
            raise DatabaseRefused(
                f"{self.url!r} is not a SQLAlchemy URL with an installed driver ({e}); accepted are e.g. "
                f"sqlite:///runs/tpbench.db, postgresql://user@host/tpbench"
            ) from None
        self.sqlite = parsed.get_backend_name() == "sqlite"
        in_memory = parsed.database in (None, "", ":memory:")
        path = Path(parsed.database) if self.sqlite and not in_memory else None
        self.file = path
        if path is not None:
            _refuse_foreign_file(path)
            if not create and not path.exists():
                raise NoDatabase(f"no database at {path} yet: `tpbench run` creates it")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseRefused(
                    f"{url}: cannot create the folder {path.parent} ({e.strerror})"
                ) from None
        self.engine = _engine(url, self.sqlite)
        self._writer = self.engine.execution_options(immediate=True)
        self._open(create)

    def _open(self, create: bool) -> None:
        """Check (and on a blank database create, on an older one upgrade) the schema, in one write
        transaction: whatever is refused or fails leaves the database as it was."""
        where = self.url
        try:
            with self._writer.begin() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_SCHEMA_LOCK})
                tables = set(inspect(conn).get_table_names())
                if not tables and not create:
                    raise NoDatabase(f"{where} has no runs yet: `tpbench run` creates them")
                if not tables:
                    Base.metadata.create_all(conn)
                    meta = {"app": APP, "schema_version": str(SCHEMA_VERSION)}
                    conn.execute(insert(Meta), [{"key": k, "value": v} for k, v in meta.items()])
                elif "meta" not in tables:
                    raise DatabaseRefused(
                        f"{where} is not a tpbench database (its tables: {', '.join(sorted(tables))}); "
                        f"left untouched: give another db.url"
                    )
                else:
                    meta = dict(conn.execute(select(Meta.key, Meta.value)).all())
                    if meta.get("app") != APP:
                        raise DatabaseRefused(
                            f"{where} has a meta table but was not written by tpbench; left untouched"
                        )
                    self._upgrade(conn, int(meta.get("schema_version", 0)))
        except OperationalError as e:
            if self.sqlite:
                raise
            raise DatabaseRefused(f"{where}: cannot connect ({str(e.orig).strip()})") from None
        except DatabaseError as e:
            raise DatabaseRefused(
                f"{where} is not a database tpbench reads ({str(e.orig).strip()}); left untouched"
            ) from None
        if self.sqlite:  # outside any transaction, and only once the file is known to be ours
            self._use_wal()

    def _upgrade(self, conn: Connection, version: int) -> None:
        """Bring a tpbench database of `version` to SCHEMA_VERSION inside the caller's transaction
        (DDL is transactional in SQLite and PostgreSQL: a failure rolls every step back)."""
        if version > SCHEMA_VERSION or any(v not in UPGRADES for v in range(version, SCHEMA_VERSION)):
            newer = "a newer tpbench" if version > SCHEMA_VERSION else "an older tpbench"
            raise DatabaseRefused(
                f"{self.url} has schema version {version}, written by {newer}; this tpbench reads version "
                f"{SCHEMA_VERSION} and has no upgrade from it: keep it with the tpbench that wrote it, or "
                f"give another db.url"
            )
        quote = conn.dialect.identifier_preparer.quote
        try:
            for v in range(version, SCHEMA_VERSION):
                for column in UPGRADES[v]:
                    kind = column.type.compile(dialect=conn.dialect)
                    conn.execute(
                        text(f"ALTER TABLE {quote(column.table.name)} ADD COLUMN {quote(column.name)} {kind}")
                    )
                if v in FILLS:
                    FILLS[v](conn)
            meta = Meta.__table__
            conn.execute(
                meta.update().where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
            )
        except DatabaseError as e:
            raise DatabaseRefused(
                f"{self.url}: upgrading schema version {version} to {SCHEMA_VERSION} failed "
                f"({str(e.orig).strip()}); left as it was"
            ) from None

    def _use_wal(self) -> None:
        """WAL, so that readers and one writer share the file. Switching to it needs the file alone for
        a moment, and SQLite answers "database is locked" at once, without its busy wait, when another
        process opens the file then: wait and look again, within the busy timeout. Once the file is in
        WAL (it stays so) the pragma is only read. A database that cannot be in WAL (SQLite in memory,
        `sqlite://`) answers the switch with its own mode: it keeps it (asking again would never end)."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        raw = self.engine.raw_connection()
        try:
            conn = raw.driver_connection
            while True:
                try:
                    if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
                        return
                    if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
                        return
                except sqlite3.OperationalError as e:
                    if "locked" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            raw.close()

    # -- writing -------------------------------------------------------------------------------------

    def logs_folder(self, cfg: RunConfig) -> Path | None:
        """Where a failed run's job folder (its config, logs, error files and rank results) is kept,
        as RUN_ID/ inside it: db.logs if given, else logs/ beside the SQLite file; None for a database
        without a file (a server, SQLite in memory) and no db.logs, where it stays under TMPDIR."""
        if cfg.db.logs:
            return Path(cfg.db.logs)
        return self.file.parent / "logs" if self.file is not None else None

    def record(self, cfg: RunConfig, outcome: Outcome) -> int:
        """Store one run with everything its ranks measured, in one transaction; returns its id. A run
        that did not end OK has its job folder moved into `logs_folder` (outcome.log_dir says where)."""
        run_id = self._insert(cfg, outcome)
        folder = self.logs_folder(cfg)
        job = outcome.job
        if folder is None or job is None or outcome.log_dir != str(job):
            return run_id  # OK (removed once recorded), or a Slurm job's folder, left where it is
        kept = (folder / str(run_id)).absolute()
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(job, kept)
        except OSError:  # it stays in the job folder, which the record names
            return run_id
        outcome.log_dir, outcome.job = str(kept), kept
        with Session(self._writer) as session, session.begin():
            session.execute(update(Run).where(Run.id == run_id).values(log_dir=str(kept)))
        return run_id

    def _insert(self, cfg: RunConfig, outcome: Outcome) -> int:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        run = Run(
            config_hash=config_hash(cfg),
            hardware=machine.of_config(cfg, outcome.env.device_name, outcome.env.device_count),
            config=public_config(cfg),
            kind=cfg.kind,
            mode=mode_label(p),
            engine=p.engine,
            tp=p.tp,
            dp=p.dp,
            sp=p.sp,
            vp=p.vp,
            layers=m.num_hidden_layers,
            hidden=m.hidden_size,
            heads=m.num_attention_heads,
            kv_heads=m.num_key_value_heads,
            vocab=m.vocab_size,
            seq=t.seq_len,
            micro_batch=t.micro_batch,
            global_batch=t.global_batch,
            batch_policy=t.batch,
            dtype=t.dtype,
            precision=t.precision,
            world_size=world_size(cfg),
            fault=cfg.fault,
            sweep=cfg.sweep,
            status=str(outcome.status),
            error=outcome.error,
            failed_rank=outcome.failed_rank,
            started_at=outcome.started_at,
            ended_at=outcome.ended_at,
            log_dir=outcome.log_dir,
            text=next((r.text for r in outcome.results if r.text), ""),
            **vars(outcome.env),
        )
        with Session(self._writer) as session, session.begin():
            session.add(run)
            session.flush()
            for table, attribute in (
                (MeasurementRow, "measurements"),
                (ParamErrorRow, "params"),
                (CommRow, "comm"),
            ):
                columns = table.__table__.c  # a figure the schema holds no column for stays in the results
                rows = [
                    {
                        **{k: v for k, v in vars(row).items() if k in columns},
                        "run_id": run.id,
                        "rank": result.rank,
                    }
                    for result in outcome.results
                    for row in getattr(result, attribute)
                ]
                if table is ParamErrorRow:
                    rows = [{**row, "shape": json.dumps(row["shape"])} for row in rows]
                if rows:
                    session.execute(insert(table), rows)
            return run.id

    # -- reading -------------------------------------------------------------------------------------

    def finished(self) -> dict[tuple[str, str], int]:
        """(config hash, hardware) -> id of its latest OK run."""
        identity = (Run.config_hash, Run.hardware)
        query = select(*identity, func.max(Run.id)).where(Run.status == "OK").group_by(*identity)
        with self.engine.connect() as conn:
            return {(config, on): run_id for config, on, run_id in conn.execute(query).all()}

    def hardware_kinds(self) -> list[str]:
        """Every hardware key the runs have, in order."""
        with self.engine.connect() as conn:
            return list(conn.scalars(select(Run.hardware).distinct().order_by(Run.hardware)))

    def run_of_job(self, slurm_job_id: str) -> tuple[int, str] | None:
        """(id, status) of the run a Slurm job recorded, if any."""
        query = select(Run.id, Run.status).where(Run.slurm_job_id == slurm_job_id).order_by(Run.id.desc())
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else (row.id, row.status)

    def runs(
        self,
        status: str | None = None,
        kind: str | None = None,
        mode: str | None = None,
        since: datetime | None = None,
        sweep: str | None = None,
        ids: Sequence[int] | None = None,
        device: str | None = None,
    ) -> pd.DataFrame:
        """One row per run (every column but the config and the text), oldest first. `device`: runs whose
        hardware holds it (case-insensitive), e.g. H100. `sweep`: the sweep of that name, else every
        sweep whose name starts with it (an automatic name is the sweep's overrides)."""
        columns = [c for c in Run.__table__.columns if c.name not in ("config", "text")]
        query = select(*columns).order_by(Run.id)
        for column, value in ((Run.status, status), (Run.kind, kind), (Run.mode, mode)):
            if value is not None:
                query = query.where(column == value)
        if sweep is not None:  # the sweep of that name, else those whose name starts with it
            named = select(Run.id).where(Run.sweep == sweep).limit(1)
            query = query.where(
                or_(Run.sweep == sweep, and_(~named.exists(), Run.sweep.startswith(sweep, autoescape=True)))
            )
        if since is not None:
            query = query.where(Run.started_at >= since)
        if ids is not None:
            query = query.where(Run.id.in_(ids))
        if device is not None:
            query = query.where(Run.hardware.icontains(device, autoescape=True))
        return self._frame(query)

    def measurements(self, run_ids: Sequence[int] | None = None) -> pd.DataFrame:
        """Long form: run_id, rank, name, value, unit, step."""
        return self._rows(MeasurementRow, run_ids)

    def param_errors(self, run_ids: Sequence[int] | None = None) -> pd.DataFrame:
        return self._rows(ParamErrorRow, run_ids)

    def comm(self, run_ids: Sequence[int] | None = None) -> pd.DataFrame:
        return self._rows(CommRow, run_ids)

    def metrics(self, run_ids: Sequence[int] | None = None) -> pd.DataFrame:
        """Wide form: one row per run, one column per metric, the headline over ranks
        (max, or the aggregation named in tpbench.results.RANK_AGGREGATION). Curves are left out."""
        import pandas as pd

        long = self.measurements(run_ids)
        long = long[long["step"].isna()]
        how = long["name"].map(lambda name: RANK_AGGREGATION.get(name, "max"))
        parts = [long[how == agg].groupby(["run_id", "name"])["value"].agg(agg) for agg in set(how)]
        if not parts:
            return pd.DataFrame(index=pd.Index([], name="run_id"))
        return pd.concat(parts).unstack("name")

    def run_record(self, run_id: int) -> dict[str, Any]:
        """One run as `tpbench run --json` prints it: id, status, error, config, metrics and the axes."""
        with Session(self.engine) as session:
            run = session.get(Run, run_id)
            if run is None:
                raise KeyError(run_id)
            fields = {c.name: getattr(run, c.name) for c in Run.__table__.columns if c.name != "text"}
            headline = select(MeasurementRow.name, MeasurementRow.value).where(
                MeasurementRow.run_id == run_id, MeasurementRow.step.is_(None)
            )
            fields["metrics"] = headline_metrics(session.execute(headline).all())
        fields |= {name: fields[name].isoformat() for name in ("started_at", "ended_at")}
        return fields

    def text(self, run_id: int) -> str:
        with Session(self.engine) as session:
            return session.scalars(select(Run.text).where(Run.id == run_id)).one()

    def configs(self, run_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """The stored config of each run, by id (`runs` names each run's DP level from it)."""
        return dict(self._frame(select(Run.id, Run.config).where(Run.id.in_(list(run_ids)))).values.tolist())

    def _rows(self, table: type[Base], run_ids: Sequence[int] | None) -> pd.DataFrame:
        query = select(*[c for c in table.__table__.columns if c.name != "id"]).order_by(table.id)
        if run_ids is not None:
            query = query.where(table.run_id.in_(list(run_ids)))
        return self._frame(query)

    def _frame(self, query: Select) -> pd.DataFrame:
        import pandas as pd

        with self.engine.connect() as conn:
            return pd.read_sql(query, conn)


class NoDatabase(DatabaseRefused):
    """Reading from a database that does not exist yet."""


def _driver_url(url: str) -> URL:
    """`postgresql://` means psycopg 3 here (SQLAlchemy alone would pick psycopg2)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend in DRIVERS and parsed.drivername == backend:
        return parsed.set(drivername=DRIVERS[backend][1])
    return parsed


def _engine(url: str, sqlite: bool) -> Engine:
    if not sqlite:
        return create_engine(_driver_url(url))
    if make_url(url).database in (None, "", ":memory:"):  # in memory: one database for every thread
        engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
    else:
        engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # SQLAlchemy, not sqlite3, begins transactions (see _on_begin); busy waits instead of failing.
        dbapi_connection.isolation_level = None
        dbapi_connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
        dbapi_connection.execute("PRAGMA foreign_keys = ON")

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        # Writers take the write lock up front: a deferred transaction that reads, then writes, fails
        # with "database is locked" at once when another process wrote in between, whatever the timeout.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("immediate") else "BEGIN")

    return engine


def _refuse_foreign_file(path: Path) -> None:
    if path.is_file() and path.stat().st_size > 0:
        with path.open("rb") as f:
            if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                raise DatabaseRefused(f"{path} is not a tpbench database (not even SQLite); left untouched")
