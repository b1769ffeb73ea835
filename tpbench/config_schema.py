"""The config schema's keys and their types, for the messages that name a bad override
(tpbench.run.compose: a close match to an unknown key, the type a value must take)."""

from __future__ import annotations

import dataclasses

from tpbench.config import RunConfig


def field_type(key: str, default: str | None = None) -> str:
    """The annotation of a schema field, e.g. 'int' for parallel.tp; `default` for a key the schema
    lacks (None: raise StopIteration)."""
    cls: type = RunConfig
    *parents, name = key.split(".")
    try:
        for part in parents:
            cls = _field(cls, part).default_factory  # type: ignore[assignment]
        return str(_field(cls, name).type)
    except (StopIteration, TypeError):
        if default is None:
            raise
        return default


def schema_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every key of the schema, e.g. model.hidden_size."""
    keys = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory
        keys += schema_keys(sub, f"{prefix}{f.name}.") if dataclasses.is_dataclass(sub) else [prefix + f.name]
    return keys


def _field(cls: type, name: str) -> dataclasses.Field:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls} has no fields")
    return next(f for f in dataclasses.fields(cls) if f.name == name)
