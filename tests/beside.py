"""Module fixtures computed beside the tests, so that the suite keeps both cores busy.

    @beside
    def validated(folder: Path) -> dict:  # the module fixture `validated`: job(a fresh folder)
        return torchrun(...)

Every such job runs in one thread beside the tests, one after another, in the order the session's tests
first need them (conftest.py starts them once the session has collected). A torchrun job then computes
on both cores while a test in this process uses one, and a fault's timeout is waited out while other
tests run. A job no selected test needs never starts; a test that needs one before it started starts it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest


class Beside:
    def __init__(self) -> None:
        self.jobs: dict[str, Callable[[Path], object]] = {}  # "module::fixture name" -> job
        self.futures: dict[str, Future] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="beside")
        self.tmp: pytest.TempPathFactory  # pytest's own, set once the session has collected

    def fixture(self, job: Callable[[Path], object]):
        key = f"{job.__module__}::{job.__name__}"
        self.jobs[key] = job

        @pytest.fixture(scope="module", name=job.__name__)
        def value():
            return self.result(key)

        return value

    def start(self, key: str) -> None:
        if key not in self.futures:
            self.futures[key] = self.pool.submit(self.jobs[key], self.tmp.mktemp(key.split("::")[1]))

    def result(self, key: str) -> object:
        self.start(key)
        return self.futures[key].result()  # the job's own exception, if it failed

    def start_for(self, items: list[pytest.Item]) -> None:
        """Start the jobs these tests need, first needed first."""
        for item in items:
            module = getattr(getattr(item, "module", None), "__name__", "")
            for name in getattr(item, "fixturenames", ()):
                if f"{module}::{name}" in self.jobs:
                    self.start(f"{module}::{name}")


BESIDE = Beside()
beside = BESIDE.fixture
