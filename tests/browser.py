"""The real headless browser the HTML tests open pages in (Debian's chromium), and the other system
programs some tests need: missing, those tests skip with the reason (scripts/setup.sh skips Debian's
packages without root), except under CI, whose set-up installs them: there they fail (tests/ci_skips.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"


def chromium(*args: str, page: Path, profile: Path) -> tuple[str, list[str]]:
    """Run headless chromium on a file: (stdout, the console messages it logged)."""
    need(CHROMIUM, "chromium")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
    ]
    done = subprocess.run(
        [CHROMIUM, *flags, *args, page.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


def need(program: str, package: str) -> None:
    """Skip (under CI: fail, tests/ci_skips.py) when `program` (a path or a command on PATH) is missing."""
    if not (Path(program).exists() or shutil.which(program)):
        pytest.skip(
            f"{program} is missing: Debian's {package} (`bash scripts/setup.sh --tests` as root installs it)"
        )
