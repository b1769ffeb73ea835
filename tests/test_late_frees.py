"""A memory run's tracker and storages freed by another thread (gloo's worker, letting go last): such a
free is counted as late unless the caller is waiting on a collective (a memory run records the count,
memory_late_frees: 0 where instrumentation.settling waits for the worker, tests/test_parallel.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from tpbench.experiments.memory import PeakTracker
from tpbench.parallel import instrumentation

pytestmark = pytest.mark.quick


def tracked(tracker: PeakTracker, n: int, numel: int = 64) -> list[torch.Tensor]:
    with tracker:
        return [torch.ones(numel) for _ in range(n)]


def free_on_another_thread(tensors: list[torch.Tensor]) -> None:
    thread = threading.Thread(target=tensors.clear)
    thread.start()
    thread.join()


def test_a_storage_freed_by_another_thread_is_late_unless_a_collective_is_waited_on():
    tracker = PeakTracker()
    tensors = tracked(tracker, 3)
    free_on_another_thread(tensors)
    assert tracker.late_frees == 3
    tensors = tracked(tracker, 2)
    with instrumentation.waiting():  # the caller blocked in a collective's wait: freed in time
        free_on_another_thread(tensors)
    assert tracker.late_frees == 3
    tensors = tracked(tracker, 2)
    tensors.clear()  # on the tracker's own thread
    assert tracker.late_frees == 3
