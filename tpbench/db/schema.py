"""The results database's schema: its tables (SQLAlchemy 2.0 declarative), its version, and the
upgrades from each older version (tpbench.db applies them, in the transaction that checks the version).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Connection, ForeignKey, String, Text, bindparam, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tpbench import machine

# 2: runs.slurm_job_id and runs.nodes; 3: comm.exposed_s; 4: runs.hardware
SCHEMA_VERSION = 5


class Base(DeclarativeBase):
    pass


class Meta(Base):
    __tablename__ = "meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    config_hash: Mapped[str] = mapped_column(String(16), index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    kind: Mapped[str] = mapped_column(String(16))
    mode: Mapped[str] = mapped_column(String(32))
    engine: Mapped[str] = mapped_column(String(16))
    tp: Mapped[int]
    dp: Mapped[int]
    sp: Mapped[bool]
    vp: Mapped[bool]
    layers: Mapped[int]
    hidden: Mapped[int]
    heads: Mapped[int]
    kv_heads: Mapped[int]
    vocab: Mapped[int]
    seq: Mapped[int]
    micro_batch: Mapped[int]
    global_batch: Mapped[int]
    batch_policy: Mapped[str] = mapped_column(String(16))
    dtype: Mapped[str] = mapped_column(String(16))
    precision: Mapped[str] = mapped_column(String(16))
    world_size: Mapped[int]
    fault: Mapped[str] = mapped_column(String(32))
    sweep: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), index=True)
    error: Mapped[str] = mapped_column(Text)
    failed_rank: Mapped[int | None]
    started_at: Mapped[datetime]  # UTC
    ended_at: Mapped[datetime]
    host: Mapped[str] = mapped_column(String(256))
    device: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(String(256))
    device_count: Mapped[int]
    backend: Mapped[str] = mapped_column(String(16))
    torch_version: Mapped[str] = mapped_column(String(64))
    cuda_version: Mapped[str | None] = mapped_column(String(32))
    git_commit: Mapped[str | None] = mapped_column(String(64))
    git_dirty: Mapped[bool | None]
    log_dir: Mapped[str | None] = mapped_column(Text)  # the job folder, kept when not OK
    slurm_job_id: Mapped[str | None] = mapped_column(String(32))  # e.g. 812 or 812_3 (an array task)
    nodes: Mapped[str | None] = mapped_column(Text)  # Slurm's node list, e.g. node[01-04]
    # tpbench.machine.key: with config_hash, the run's identity. Every row has one (an upgrade labels
    # the older rows); nullable only as every column an upgrade adds is.
    hardware: Mapped[str | None] = mapped_column(Text)
    text: Mapped[str] = mapped_column(Text)  # rank 0's readable summary


class MeasurementRow(Base):
    __tablename__ = "measurements"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    rank: Mapped[int]
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float]
    unit: Mapped[str] = mapped_column(String(16))
    step: Mapped[int | None]  # None: a per-run figure; otherwise one point of a curve


class ParamErrorRow(Base):
    __tablename__ = "param_errors"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    rank: Mapped[int]
    name: Mapped[str] = mapped_column(String(256))
    semantics: Mapped[str] = mapped_column(String(32))
    shape: Mapped[str] = mapped_column(String(64))  # JSON list
    grad_mean_abs: Mapped[float]
    grad_max_abs: Mapped[float]
    grad_rel_l2: Mapped[float]
    # version 5 (tpbench.results.ParamRow): the reference model's figures and the AdamW parameters'
    grad_ref_rel_l2: Mapped[float | None]
    param_max_abs: Mapped[float | None]
    param_rel_l2: Mapped[float | None]
    param_ref_rel_l2: Mapped[float | None]


class CommRow(Base):
    __tablename__ = "comm"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    rank: Mapped[int]
    op: Mapped[str] = mapped_column(String(32))
    purpose: Mapped[str] = mapped_column(String(32))  # what it moves: activation, grad_sum, loss, ...
    count: Mapped[int]
    bytes: Mapped[int] = mapped_column(BigInteger)
    time_s: Mapped[float | None]
    exposed_s: Mapped[float | None]  # the part of time_s the rank waited (parallel.overlap hides the rest)


# version -> the columns its upgrade to version + 1 adds, as declared above (an upgrade only adds
# nullable columns: the rows kept read as NULL there, unless FILLS fills them)
_PARAM_ERRORS = ParamErrorRow.__table__.c
UPGRADES = {
    2: (CommRow.__table__.c.exposed_s,),
    3: (Run.__table__.c.hardware,),
    4: (
        _PARAM_ERRORS.grad_ref_rel_l2,
        _PARAM_ERRORS.param_max_abs,
        _PARAM_ERRORS.param_rel_l2,
        _PARAM_ERRORS.param_ref_rel_l2,
    ),
}


def _label_hardware(conn: Connection) -> None:
    """Version 3 -> 4: each run's hardware from the device name, device count and config it recorded."""
    runs = Run.__table__
    recorded = select(runs.c.id, runs.c.device, runs.c.device_name, runs.c.device_count, runs.c.config)
    labels = [{"run": row.id, "label": _hardware_of_row(row)} for row in conn.execute(recorded)]
    if labels:
        query = runs.update().where(runs.c.id == bindparam("run")).values(hardware=bindparam("label"))
        conn.execute(query, labels)


def _hardware_of_row(row: Any) -> str:
    launch = (row.config or {}).get("launch", {})  # a version-2 config may lack it: one node, real ranks
    nnodes, emulate = str(launch.get("nnodes", "1")), launch.get("emulate", "none")
    return machine.key(row.device, row.device_name, row.device_count, nnodes, emulate)


# version -> what its upgrade does to the rows kept, once UPGRADES' columns are there
FILLS = {3: _label_hardware}
