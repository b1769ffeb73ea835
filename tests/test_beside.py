"""Jobs beside the tests (tests/beside.py) as pytest sees them: a job's fixture imported into another
test module is that job there too, so the quick tier (`quick` in conftest.py) leaves out a test that
waits on it (test_theory_peak_moment's tests, on test_theory's world-4 job: once 574 s of the tier's
setup, when a job was looked up by the item's own module alone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = """
from beside import BESIDE

def pytest_collection_modifyitems(items):
    for item in items:
        print("NEEDS", item.nodeid, [n for n in item.fixturenames if BESIDE.needs(item, n)])

def pytest_collection_finish(session):
    BESIDE.tmp = session.config._tmp_path_factory
    BESIDE.start_for(session.items)

def pytest_sessionfinish(session):
    BESIDE.shutdown()
"""
TESTS = {
    "test_a.py": """
from beside import beside

@beside
def measured(folder):
    return folder.name

def test_a(measured):
    assert measured.startswith("measured")
""",
    "test_b.py": """
from test_a import measured  # noqa: F401

def test_b(measured):
    assert measured.startswith("measured")

def test_c():
    pass
""",
    "test_d.py": """
from beside import beside

@beside
def looked_up(folder):  # as in the quick tier: no selected test names it
    return folder.name

def test_d_looks_it_up(request):
    assert request.getfixturevalue("looked_up").startswith("looked_up")
""",
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The files above, with BESIDE's hooks as conftest.py has them."""
    folder = tmp_path_factory.mktemp("beside")
    (folder / "conftest.py").write_text(CONFTEST)
    for name, text in TESTS.items():
        (folder / name).write_text(text)
    return folder


def pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # run by a worker
    env["PYTHONPATH"] = str(Path(__file__).parent)
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *args, str(folder)]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def session(folder: Path) -> subprocess.CompletedProcess:
    return pytest_in(folder)


def test_a_job_imported_into_another_module_is_a_job_there_too(session):
    needs = [line for line in session.stdout.splitlines() if line.startswith("NEEDS")]
    assert needs == [
        "NEEDS test_a.py::test_a ['measured']",
        "NEEDS test_b.py::test_b ['measured']",
        "NEEDS test_b.py::test_c []",
        "NEEDS test_d.py::test_d_looks_it_up []",
    ]
    assert "3 passed" in session.stdout, session.stdout + session.stderr


def test_a_job_looked_up_inside_a_test_is_refused(session):
    """Unseen by its fixtures, it would start in the quick tier (test_sharded_dp's broken levels once
    launched two torchrun jobs there)."""
    assert "1 failed, 3 passed" in session.stdout, session.stdout + session.stderr
    assert "LookupError: job test_d::looked_up was not started for the collected tests" in session.stdout


def test_xdist_workers_start_no_job_and_refuse_the_tests_that_wait_on_one(folder: Path):
    """Under `-n 2` each worker is a session of its own: a job would run once per worker. None starts;
    the tests that wait on one fail with the line that says so, the others run."""
    done = pytest_in(folder, "-n", "2")
    assert "1 failed, 1 passed, 2 errors" in done.stdout, done.stdout + done.stderr  # test_c passed
    for job in ("test_a::measured", "test_d::looked_up"):
        said = f"LookupError: job {job} was not started for the collected tests: under pytest-xdist (-n)"
        assert said in done.stdout
