"""What tpbench measures of its collectives, and the modes they run in.

Every collective of `tpbench.parallel.collectives` reports to the active `CommCounter` (`counting`):
count and per-rank ring bytes on the wire (`ring_bytes`), by op and purpose, an async one the same as
its blocking twin; timed, also its total time and the part of it the caller spent waiting (exposed: a
blocking collective is all exposed), by the counter's `tpbench.parallel.timing` timer: the wall clock
on gloo, CUDA events on NCCL. With `log=True` it keeps each one, in the order issued, as a `CommEvent`
(what `tpbench diagram` draws). `tpbench.predict.theory` predicts the same bytes with the same `ring_bytes`.

Two modes change how a collective issued now runs: `recomputing` counts it under the purpose
"recompute", `settling` makes its wait return only once gloo has let go of its tensors (for a memory
tracker).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tpbench.parallel import timing
from tpbench.results import CommRow


def ring_bytes(op: str, full_bytes: int, world: int) -> int:
    """Per-rank bytes on the wire of one ring collective over `world` ranks, N = `full_bytes` (the full
    tensor's: the all-reduced one, the gathered one, the one reduce-scattered): all-reduce 2(T-1)/T * N,
    all-gather and reduce-scatter (T-1)/T * N. Rounded to whole bytes per collective."""
    factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    return round(full_bytes * factor)


@dataclass(frozen=True)
class CommEvent:
    """One collective as this rank issued it."""

    op: str
    purpose: str
    shape: tuple[int, ...]  # the tensor handed to the collective on this rank
    dtype: str
    ranks: tuple[int, ...]  # the group, as global ranks
    bytes: int  # per-rank ring bytes, as counted


class CommCounter:
    """Counts the collectives issued while active, in per-rank ring bytes (`ring_bytes`).
    `timed=True` also times them with `timer` (the wall clock unless given); `log=True` also keeps
    every collective in issue order in `events`."""

    def __init__(self, timed: bool = False, log: bool = False, timer: timing.CollectiveTimer | None = None):
        self.timed = timed
        self.timer: timing.CollectiveTimer = timer or timing.WallClockTimer()
        # (op, purpose) -> [count, bytes, seconds, exposed seconds]
        self.stats: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
        self.events: list[CommEvent] | None = [] if log else None

    def record(
        self,
        op: str,
        purpose: str,
        full_bytes: int,
        world: int,
        seconds: float,
        shape: tuple[int, ...] = (),
        dtype: str = "",
        ranks: tuple[int, ...] = (),
        exposed: float | None = None,
    ) -> None:
        """One collective issued. `exposed`: the seconds the caller waited on it (None: all of them)."""
        wire = ring_bytes(op, full_bytes, world)
        entry = self.stats[(op, purpose)]
        entry[0] += 1
        entry[1] += wire
        self.add_time(op, purpose, seconds, seconds if exposed is None else exposed)
        if self.events is not None:
            self.events.append(CommEvent(op, purpose, shape, dtype, ranks, wire))

    def add_time(self, op: str, purpose: str, seconds: float, exposed: float) -> None:
        entry = self.stats[(op, purpose)]
        entry[2] += seconds
        entry[3] += exposed

    def rows(self, steps: int = 1) -> list[CommRow]:
        """Per (op, purpose), per step. Call it after the step: the timer's unread times are read here
        (with CUDA events, after one synchronisation)."""
        if self.timed:
            self.timer.resolve()
        return [
            CommRow(
                op,
                purpose,
                int(n // steps),
                int(b // steps),
                t / steps if self.timed else None,
                e / steps if self.timed else None,
            )
            for (op, purpose), (n, b, t, e) in sorted(self.stats.items())
        ]

    def reset(self) -> None:
        self.stats.clear()
        if self.events is not None:
            self.events.clear()


_counter: CommCounter | None = None


@contextlib.contextmanager
def counting(counter: CommCounter) -> Iterator[CommCounter]:
    """Inside, every collective issued reports to `counter` (the innermost `counting`'s)."""
    global _counter
    previous, _counter = _counter, counter
    try:
        yield counter
    finally:
        _counter = previous


def active_counter() -> CommCounter | None:
    """The counter a collective issued now reports to, if any."""
    return _counter


def timed() -> bool:
    """Whether the active counter times the collectives issued now."""
    return _counter is not None and _counter.timed


_recomputing = False


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Collectives issued inside are counted under the purpose "recompute": a block's forward run
    again in backward by activation recompute (tpbench.parallel.recompute)."""
    global _recomputing
    previous, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = previous


def counted_purpose(purpose: str) -> str:
    """The purpose a collective issued now for `purpose` is counted under."""
    return "recompute" if _recomputing else purpose


# --- settling: gloo letting go of a collective's tensors ---------------------------------------

_settling = False


@contextlib.contextmanager
def settling() -> Iterator[None]:
    """Each collective leaves no tensor a memory tracker counts in its backend's hands, for a memory
    tracker: over gloo tpbench's collectives run on staging copies no tracker sees
    (collectives._launch), and so do the dtensor engine's functional ones (memory.PeakTracker); what
    follows is why, and what an unstaged one (DDP's buckets) still waits for.

    gloo runs a collective on a worker thread that wakes the caller as soon as the result is ready,
    then drops its own references to the input and output a moment later. When the caller's were the
    other references, the tensor is freed at a moment the thread scheduler chooses: measured here, a
    gathered [S, B, H] freed after the LM head's next op made MemTracker's peak 12.5-14 KB higher on one
    random rank in a few percent of steps (tp 4, SP + VP). Waiting for the worker to drop them, until
    every count of references to the tensors was back where it was (tensor and storage, strong and
    weak), still let 2-10 of 3,000 all-reduces through on a loaded 2-core machine: the worker held
    the tensor again after the counts said it had let go (a CI run's T 4, VP peak 16 KB high on one
    rank). A staging copy is waited for by nobody: it is never counted.

    gloo's reduce-scatter also makes a tensor of its own: it all-reduces a clone of the input, and its
    wait(), on the caller's thread, copies this rank's chunk out of it (the chunk is the op a memory
    tracker sees). The worker drops its reference to the clone a moment after the all-reduce, so the
    clone too outlived the wait now and then: a [S, B, H] 16 KB more at the final norm's backward on
    one random rank, in 7 of 10 steps on a faster CPU (dp 2 x tp 2, SP + VP). Every storage the wait
    makes visible is waited on as well, until it is freed or is the result's."""
    global _settling
    previous, _settling = _settling, True
    try:
        yield
    finally:
        _settling = previous


def is_settling() -> bool:
    """Whether a collective issued now settles (inside `settling`)."""
    return _settling


_waiting = False


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a settling collective's wait: a storage the backend's thread frees meanwhile is freed
    in time (before the caller goes on), as one freed at any other moment is not (`is_waiting`)."""
    global _waiting
    previous, _waiting = _waiting, True
    try:
        yield
    finally:
        _waiting = previous


def is_waiting() -> bool:
    """Whether the caller is inside a settling collective's wait (`waiting`)."""
    return _waiting


class MadeStorages(TorchDispatchMode):
    """Weak references to the storages of what ops return while it is on (a backend's wait())."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.storages.append(weakref.ref(t.untyped_storage()))
        return out


def references(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[int, int], ...]:
    """Per tensor, the references to it and to its storage: what `settle_released` compares.

    Both count: gloo's worker holds some tensors as they are, others through views of their storage
    (all_gather_into_tensor's output cut into one chunk per rank), which leave the tensor's own count
    alone. Counted on the tensor only, a gathered [S, B, H] whose caller had let go was freed by the
    worker thread at a moment of its own: 9.5-16 KB late on one random rank (T 4, SP; DP 2 x T 2,
    SP + VP, mixed), and once 2 KB in CI (T 4, VP)."""
    return tuple((t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)) for t in tensors)


SETTLE_LIMIT_S = 120.0  # a backend still holding a collective's tensors after this: an error, not a race


def settle_released(
    tensors: tuple[torch.Tensor, ...], before: tuple[tuple[int, int], ...], made: Sequence[weakref.ref] = ()
) -> None:
    """Until the backend holds no more references to `tensors` or their storages than before the
    collective (`references`), and the storages its wait made (`made`) are freed, bar the result's:
    however long its thread takes to let go, so that whatever it frees is freed inside the wait.

    A wait that gave up after 1 s (as this one did) let a worker thread descheduled longer on a loaded
    machine free a tensor at a moment of its own, after the caller had dropped it: that rank's peak held
    it meanwhile (a few small storages now and then under CI's load). A backend that never lets go is a
    bug: an error after `SETTLE_LIMIT_S`, not a silent late free."""
    kept = {t.untyped_storage()._cdata for t in tensors}

    def held() -> bool:
        now = references(tensors)
        if any(n[0] > b[0] or n[1] > b[1] for n, b in zip(now, before, strict=True)):
            return True
        return any((s := ref()) is not None and s._cdata not in kept for ref in made)

    start, spins = time.perf_counter(), 0
    while held():
        spins += 1
        time.sleep(0 if spins < 1000 else 1e-4)  # microseconds as a rule; a starved thread, longer
        if time.perf_counter() - start > SETTLE_LIMIT_S:
            raise RuntimeError(f"the backend still holds a collective's tensors after {SETTLE_LIMIT_S:g} s")
