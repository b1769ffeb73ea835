"""scripts/system-packages.sh (setup.sh's Debian part) as a user without root or sudo, on a PATH
without Graphviz, g++ and chromium: it skips them with one line saying what goes without them, and
the set-up goes on (exit 0); `tpbench run` needs none of them."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "system-packages.sh"
TOOLS = ("bash", "env", "id", "sed", "grep", "sort", "paste", "printf", "cat", "fc-list", "apt-get")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder the unprivileged user can reach (pytest's own tmp folders are root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="tpbench-setup-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture
def bare_path(open_dir: Path) -> Path:
    """A PATH of the shell's basics and apt-get alone: no dot, g++, chromium or sudo."""
    bin_dir = open_dir / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        if found := shutil.which(tool):
            (bin_dir / tool).symlink_to(found)
    return bin_dir


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged user needs root")
def test_without_root_the_system_packages_are_skipped_in_one_line(open_dir, bare_path):
    script = open_dir / "system-packages.sh"
    shutil.copy(SCRIPT, script)
    done = subprocess.run(
        [
            shutil.which("setpriv") or "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "bash",
            str(script),
            "--tests",
        ],
        env={"PATH": str(bare_path), "HOME": str(open_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("setup.sh: not root and no passwordless sudo"), line
    for package in ("graphviz", "g++", "chromium"):
        assert package in line
    for goes in ("tpbench diagram fails", "train.compile fails", "the browser tests"):
        assert goes in line
