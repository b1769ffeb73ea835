"""The real headless browser the HTML tests open pages in (Debian's chromium: missing, they fail)."""

from __future__ import annotations

import subprocess
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"


def chromium(*args: str, page: Path, profile: Path) -> tuple[str, list[str]]:
    """Run headless chromium on a file: (stdout, the console messages it logged)."""
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install chromium (CI: .ci/run does)"
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
