"""Module fixtures computed beside the tests, so that the suite keeps both cores busy.

    @beside
    def validated(folder: Path) -> dict:  # the module fixture `validated`: job(a fresh folder)
        return torchrun(...)

    @beside(waits=True)
    def faulted(folder: Path) -> ...:  # a job that spends most of its time waiting out timeouts

Every such job runs in a thread beside the tests, one after another in its lane, in the order the
session's tests first need them (conftest.py starts them once the session has collected). A torchrun
job then computes on both cores while a test in this process uses one. Jobs that mostly wait (a hang
waiting out its collective timeout) have a lane of their own, so that their waiting leaves no core idle.
A job no selected test needs never starts. A test must name the jobs it waits on as its fixtures: one
looked up inside it (request.getfixturevalue) would start unseen, in the quick tier too (conftest.py's
`quick` reads the fixtures), and is refused. Under pytest-xdist (`-n 2`) each worker is a session of
its own and would run every job again: none starts there, and a test that waits on one is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest


class Beside:
    def __init__(self) -> None:
        self.jobs: dict[str, tuple[Callable[[Path], object], str]] = {}  # "module::fixture" -> job, lane
        self.futures: dict[str, Future] = {}
        self.keys: dict[Callable[[], object], str] = {}  # each job's fixture function -> its key
        self.lanes = {
            lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"beside-{lane}")
            for lane in ("computes", "waits")
        }
        self.tmp: pytest.TempPathFactory  # pytest's own, set once the session has collected

    def fixture(self, job: Callable[[Path], object] | None = None, *, waits: bool = False):
        if job is None:  # @beside(waits=True)
            return lambda job: self.fixture(job, waits=waits)
        key = f"{job.__module__}::{job.__name__}"
        self.jobs[key] = job, "waits" if waits else "computes"

        def value():
            return self.result(key)

        self.keys[value] = key  # pytest's FixtureDef holds this function, in any module that imports it
        return pytest.fixture(scope="module", name=job.__name__)(value)

    def start(self, key: str) -> None:
        if key not in self.futures:
            job, lane = self.jobs[key]
            self.futures[key] = self.lanes[lane].submit(job, self.tmp.mktemp(key.split("::")[1]))

    def result(self, key: str) -> object:
        if key not in self.futures:
            why = (
                "under pytest-xdist (-n) each worker is a session of its own, which would run it again: "
                "accepted are -n with -m quick, or no -n"
                if under_xdist()
                else "a test looked it up inside itself (request.getfixturevalue); name it among its fixtures"
            )
            raise LookupError(f"job {key} was not started for the collected tests: {why}")
        return self.futures[key].result()  # the job's own exception, if it failed

    def key(self, item: pytest.Item, fixture: str) -> str | None:
        """The job behind `fixture` as `item` sees it, if it is one: defined in the item's module or
        imported into it from another test module (test_theory_peak_moment's `measured`)."""
        info = getattr(item, "_fixtureinfo", None)
        for definition in getattr(info, "name2fixturedefs", {}).get(fixture, ()):
            if definition.func in self.keys:
                return self.keys[definition.func]
        return None

    def lane(self, item: pytest.Item, fixture: str) -> str | None:
        """The lane ("computes" or "waits") of the job behind `fixture` as `item` sees it; None: no job."""
        key = self.key(item, fixture)
        return None if key is None else self.jobs[key][1]

    def needs(self, item: pytest.Item, fixture: str) -> bool:
        """Whether `fixture`, as `item` sees it, is a job beside the tests."""
        return self.lane(item, fixture) is not None

    def start_for(self, items: list[pytest.Item]) -> None:
        """Start the jobs these tests need, first needed first (none in a pytest-xdist worker)."""
        if under_xdist():
            return
        for item in items:
            for name in getattr(item, "fixturenames", ()):
                if key := self.key(item, name):
                    self.start(key)

    def shutdown(self) -> None:
        for lane in self.lanes.values():
            lane.shutdown(cancel_futures=True)  # the job under way ends first


def under_xdist() -> bool:
    """In a worker of pytest-xdist (`-n 2`, for the quick tier): a session of its own, like its siblings."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


BESIDE = Beside()
beside = BESIDE.fixture
