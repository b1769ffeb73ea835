"""tests/ci_skips.py in a pytest of its own: under CI a skip for a missing part fails (a skipped module
too), a test marked torch_build still skips, and the summary says so; outside CI they all skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = {
    "test_parts.py": """
import pytest

def test_missing_part():
    pytest.skip("chromium is missing")

@pytest.mark.skipif(True, reason="needs root")
def test_not_root():
    pass

@pytest.mark.torch_build
def test_other_torch():
    pytest.skip("torch is built with CUDA")

@pytest.mark.xfail(reason="known", strict=True)
def test_known():
    assert False

def test_fine():
    pass
""",
    "test_module_skipped.py": """
import pytest

pytest.importorskip("no_such_module_anywhere")

def test_x():
    pass
""",
}


def pytest_in(folder: Path, ci: str) -> subprocess.CompletedProcess:
    for name, text in TESTS.items():
        (folder / name).write_text(text)
    env = dict(os.environ, CI=ci, PYTHONPATH=str(Path(__file__).parent))
    command = [sys.executable, "-m", "pytest", "-p", "ci_skips", "-rA", "--continue-on-collection-errors"]
    return subprocess.run(
        [*command, "-p", "no:cacheprovider", str(folder)], cwd=folder, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_skip_for_a_missing_part_fails_the_run(tmp_path, ci):
    done = pytest_in(tmp_path, ci)
    assert done.returncode == 1, done.stdout
    assert "FAILED test_parts.py::test_missing_part - skipped under CI" in done.stdout
    assert "ERROR test_parts.py::test_not_root - skipped under CI" in done.stdout  # at its set-up
    assert "chromium is missing" in done.stdout and "needs root" in done.stdout
    assert "ERROR test_module_skipped.py" in done.stdout and "no_such_module_anywhere" in done.stdout
    assert "SKIPPED [1] test_parts.py" in done.stdout and "torch is built with CUDA" in done.stdout
    assert "XFAIL test_parts.py::test_known" in done.stdout
    assert "PASSED test_parts.py::test_fine" in done.stdout
    assert "CI: 1 skipped, each marked torch_build (it needs the other build of torch)" in done.stdout


def test_outside_ci_a_missing_part_skips_with_its_reason(tmp_path):
    done = pytest_in(tmp_path, "")
    assert done.returncode == 0, done.stdout
    assert "1 passed, 4 skipped, 1 xfailed" in done.stdout
    assert "4 skipped: a part of this machine missing" in done.stdout
