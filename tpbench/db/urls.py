"""What a database URL needs before tpbench opens it (a driver, a SQLAlchemy URL), and `--since`'s
times: checked with the rest of a run's config, before anything launches (tpbench.db re-exports them)."""

from __future__ import annotations

import importlib.util
import re
from datetime import UTC, datetime, timedelta

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from tpbench.config import hide_password

# SQLAlchemy backend -> (the DBAPI module tpbench drives it with, the dialect+driver, what installs it)
DRIVERS = {"postgresql": ("psycopg", "postgresql+psycopg", "pip install 'tpbench[postgres]'")}


def parse_since(text: str) -> datetime:
    """`--since`: an ISO date or time (UTC), or an age such as 30m, 12h, 7d."""
    age = re.fullmatch(r"(\d+)([mhd])", text)
    if age:
        unit = {"m": "minutes", "h": "hours", "d": "days"}[age[2]]
        return datetime.now(UTC).replace(tzinfo=None) - timedelta(**{unit: int(age[1])})
    return datetime.fromisoformat(text)


def driver_missing(url: str) -> str | None:
    """One line saying what to install when the URL needs a driver this Python lacks, else None (also
    for a URL that does not parse: that is said where the URL is read)."""
    try:
        backend = make_url(url).get_backend_name()
    except (ArgumentError, ValueError):
        return None
    if backend in DRIVERS and importlib.util.find_spec(DRIVERS[backend][0]) is None:
        module, _, install = DRIVERS[backend]
        return f"db.url={hide_password(url)!r} needs the {module} driver, which is not installed: {install}"
    return None


def url_refused(url: str) -> str | None:
    """One line saying why a run's db.url cannot be written to (a driver to install, not a URL, no
    such driver), else None: checked with the rest of a run's config, before anything launches."""
    missing = driver_missing(url)  # first: what to install says more than a failed import
    if missing:
        return missing
    try:
        make_url(url).get_dialect().import_dbapi()
    except (ArgumentError, NoSuchModuleError, ImportError, ValueError) as e:
        return (
            f"db.url={hide_password(url)!r}: not a SQLAlchemy URL with an installed driver ({e}); accepted "
            f"are e.g. sqlite:///runs/tpbench.db, postgresql://user@host/tpbench"
        )
    return None
