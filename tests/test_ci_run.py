"""`.ci/run` itself, over a stand-in set-up and a stand-in pytest: it sets CI=true whoever runs it,
and fails a test command that runs past its budget (docs/development.md#ci)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A tree with the real .ci/run, a set-up that does nothing and a .venv/bin/python that records
    its environment and arguments, then sleeps TEST_SLEEP seconds and exits TEST_CODE."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text('echo "setup $*" > setup.log\n')
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/usr/bin/env bash\n"
        'echo "CI=$CI OMP_NUM_THREADS=$OMP_NUM_THREADS args=$*" > pytest.log\n'
        'sleep "${TEST_SLEEP:-0}"\n'
        'exit "${TEST_CODE:-0}"\n'
    )
    python.chmod(0o755)
    return tmp_path


def ci_run(checkout: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "TPBENCH_TEST_BUDGET_S")}
    return subprocess.run(
        ["bash", str(checkout / ".ci" / "run")],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_hand_run_is_the_ci_run(checkout):
    done = ci_run(checkout)  # no CI in the environment, as a developer's shell
    assert done.returncode == 0, done.stderr
    assert (checkout / "setup.log").read_text().split() == ["setup", "--tests"]
    assert (checkout / "pytest.log").read_text().split() == [
        "CI=true",
        "OMP_NUM_THREADS=1",
        "args=-m",
        "pytest",
        "-q",
    ]
    assert (
        "ci: the test command took" in done.stderr
        and "of its 1800 s budget: within the 10-minute goal" in done.stderr
    )


def test_the_test_command_past_its_budget_fails_the_run(checkout):
    done = ci_run(checkout, TPBENCH_TEST_BUDGET_S="1", TEST_SLEEP="5")
    assert done.returncode == 1
    assert "ci: the test command ran past its budget, 1 s" in done.stderr


def test_the_test_commands_own_failure_is_the_runs(checkout):
    done = ci_run(checkout, TEST_CODE="3")
    assert done.returncode == 3
