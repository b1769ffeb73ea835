"""How a timed training step's collectives, and the steps themselves, are timed: one interface, two
implementations, picked by `uses_cuda_events(device, backend)`.

Wall clock (gloo, every backend but NCCL): `WallClockTimer` and `WallClockSteps`, the host's
perf_counter.
  total     from when the group could start it to the moment the backend finished it: from just
            before the launch, or from the end of the group's previous collective if that came later
            (a collective queued behind another of its group is not running yet: its wait there is
            not communication), to its finish, which gloo tells by completing the Work's future on
            its worker thread (the future's done callback), if that came before the wait; if the
            caller was waiting by then, to the return of the wait (waking the caller is part of it:
            measured here under load, a wait returned 8 ms after the callback, 9 times the
            collective, and DDP's hidden fraction read -7.9). A blocking collective: to the return
            of its wait.
  exposed   the time the caller spent in wait() (settling included), at most total; a blocking
            collective: all of it.
            A Work without a future (gloo's reduce_scatter_single, an all-reduce inside) is timed from
            its wait: total = exposed, never hidden.
  step      barrier to barrier: the slowest rank's.
  Limits: CUDA tensors on such a backend (gloo with launch.device=cuda) are timed with the device
  synchronised before each launch and after each wait, which serialises the step.

CUDA events (NCCL): `CudaEventTimer` and `CudaEventSteps`. NCCL runs a collective on a stream of its
own, N: at the launch N waits on the compute stream C (an event NCCL records there), and `wait()` makes
C wait on N's end; neither blocks the host. The Work's future is complete as soon as the kernel is
enqueued, so the host time of its callback says nothing of when the collective ended. Per collective:
  launch    an event on C just before the launch: N cannot start the collective before C gets there;
  end       an event on a timing stream of the collective's group, after that stream waited on the
            Work's future (`Future.wait()` orders the current stream after the collective's kernels
            and returns at once): it fires when N has finished the collective;
  before, after   events on C just before and just after `wait()` (async collectives).
  total     start -> end, where start is the later of C reaching the launch and the end of the
            group's previous collective on N (end of k minus max(launch of k, end of k-1)): the
            kernel's wait for its peers included, its wait behind an earlier collective of its group
            not (that one's time already counts it). Two collectives of 2 ms and 1 ms launched together
            take 3 ms of comm, not 2 + 3 ms, so comm_hidden_fraction reads the truth.
  exposed   before -> after: how long C stalled at the wait, at most total (it starts after the launch
            and ends with N's end; only event latency could pass it, and is clamped), so
            comm_hidden_fraction lies in [0, 1]. A blocking collective: all of its total.
  step      the timed steps run back to back, as training runs them, between one synchronise and
            barrier before the first and one after the last: an event on C between each two steps,
            a step's time from the event before it to the one after it, each rank's own (the caller
            takes the slowest rank's); the host runs ahead into the next step while C finishes this
            one. Beside it the host's issue time: from the call of the step to its return, the time
            the host takes to enqueue it; `host_bound` when that is >= 90% of the step (the GPU then
            waits for the host). The first step (compiling under train.compile) is timed alone.
  Every event is read once, after the timed steps: `resolve()` synchronises the device once and takes
  the elapsed times; nothing inside the timed window synchronises.
  Limits: exposed is an upper bound of what the collective cost the step where C was itself idle
  before the wait (a host behind the GPU: the stall then took the place of idle time, not of compute).
  Collectives of different groups in flight together overlap in time, so their totals can add up to
  more than the step (those of one group cannot: each starts its time where the one before ended).
  NCCL's own timing (TORCH_NCCL_ENABLE_TIMING=1, `Work._get_duration()`) measures from N's start of
  the kernel, after its wait on C; it needs each Work kept until after the step, and with it every
  tensor the Work holds, so it serves only as a cross-check (benchmarks/cuda_timing_check.py).

The event source is injectable (`EventSource`): tests drive `CudaEventTimer` with a fake GPU clock.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

Report = Callable[[float, float], None]  # (total seconds, exposed seconds) of one collective
WALL_CLOCK, CUDA_EVENTS = "wall_clock", "cuda_events"


def uses_cuda_events(device: torch.device, backend: str) -> bool:
    """Whether a run on `device` over `backend` times with CUDA events (else with the wall clock)."""
    return device.type == "cuda" and backend == "nccl"


class Span(Protocol):
    """One collective being timed: told when it was launched and when its wait begins and ends."""

    def launched(self, work) -> None: ...

    def waiting(self) -> None: ...

    def waited(self) -> None: ...


class CollectiveTimer(Protocol):
    method: str  # WALL_CLOCK or CUDA_EVENTS

    def start(self, x: torch.Tensor, group: object, blocking: bool, report: Report) -> Span:
        """Called just before the collective on `x` is launched on `group`; `report` is handed its
        times once they are known (at its wait on the wall clock, at `resolve()` with events)."""
        ...

    def resolve(self) -> None:
        """After the step: report the times still unread."""
        ...


class StepTimes(NamedTuple):
    """The timed steps of one window: each one's time, and (CUDA events) the host's time to issue it."""

    device: list[float]  # seconds of each step (see the clocks)
    issue: list[float]  # CUDA events: seconds the host took to enqueue each step; wall clock: none


HOST_BOUND = 0.9  # a step whose issue takes at least this fraction of its device time is host-bound


def host_bound(issue_s: float, step_s: float) -> bool:
    """Whether the host, not the GPU, set the step's pace: enqueueing it took >= 90% of its time."""
    return issue_s >= HOST_BOUND * step_s


class StepClock(Protocol):
    method: str

    def time(self, step: Callable[[], object], sync: Callable[[], None]) -> float:
        """Seconds of one call of `step`; `sync` (synchronise and barrier) is called before and after."""
        ...

    def steps(
        self, step: Callable[[], object], sync: Callable[[], None], count: int, between: Callable[[], None]
    ) -> StepTimes:
        """`count` calls of `step`, timed each; `between` runs after each, outside its time."""
        ...


# --- wall clock --------------------------------------------------------------------------------


class WallClockTimer:
    method = WALL_CLOCK

    def __init__(self) -> None:
        self._last: dict[int, _WallClockSpan] = {}  # id(group) -> its latest collective
        self._groups: list[object] = []  # the groups keyed, kept alive so that no id is reused

    def start(self, x: torch.Tensor, group: object, blocking: bool, report: Report) -> Span:
        previous = self._last.get(id(group))
        if previous is None:
            self._groups.append(group)
        span = _WallClockSpan(x.device if x.is_cuda else None, blocking, report, previous)
        self._last[id(group)] = span
        return span

    def resolve(self) -> None:
        pass  # every time was reported at its wait


class _WallClockSpan:
    def __init__(
        self, cuda: torch.device | None, blocking: bool, report: Report, previous: _WallClockSpan | None
    ) -> None:
        self.cuda, self.blocking, self.report = cuda, blocking, report
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        self.begin = time.perf_counter()
        self.done: list[float] = []  # when the backend finished, were it before the wait
        self.previous = previous  # the group's collective before this one: this one queues behind it
        self.finished: float | None = None  # when it finished, once known (its total's end)

    def finished_at(self) -> float | None:
        """When the backend finished it, if known yet: its future's callback, or its total's end."""
        if self.finished is not None:
            return self.finished
        return self.done[0] if self.done and self.done[0] != math.inf else None

    def launched(self, work) -> None:
        if self.blocking:
            return
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's reduce_scatter_single (an all-reduce inside) has no future
            future = None
        if future is not None:
            future.add_done_callback(lambda _: self.done.append(time.perf_counter()))
        else:  # no finishing time: counted as all exposed, never as hidden
            self.done.append(math.inf)

    def waiting(self) -> None:
        self.waiting_at = time.perf_counter()

    def waited(self) -> None:
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
        end = time.perf_counter()
        if self.done and self.done[0] == math.inf:
            start, finish = self.waiting_at, end
        else:
            # a collective that ended during its wait: to the wait's return
            ended_early = not self.blocking and self.done and self.done[0] <= self.waiting_at
            start, finish = self.begin, self.done[0] if ended_early else end
            before = self.previous.finished_at() if self.previous is not None else None
            if before is not None:  # queued behind the group's previous collective until it ended
                start = min(max(start, before), finish)
        self.finished, self.previous = finish, None  # the chain is not kept beyond one link
        total = finish - start
        self.report(total, total if self.blocking else min(end - self.waiting_at, total))


class WallClockSteps:
    method = WALL_CLOCK

    def time(self, step: Callable[[], object], sync: Callable[[], None]) -> float:
        """Seconds of one `step` from barrier to barrier (`sync`): the slowest rank's."""
        sync()
        start = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - start

    def steps(
        self, step: Callable[[], object], sync: Callable[[], None], count: int, between: Callable[[], None]
    ) -> StepTimes:
        """Each step barrier to barrier: on a CPU the host's time is the step (no issue time apart)."""
        times = []
        for _ in range(count):
            times.append(self.time(step, sync))
            between()
        return StepTimes(times, [])


# --- CUDA events -------------------------------------------------------------------------------


class Event(Protocol):
    def record(self, stream=None) -> None: ...

    def elapsed_time(self, end: Event) -> float: ...  # milliseconds


class EventSource(Protocol):
    """The GPU as the event timers see it: the current device's events and streams."""

    def event(self) -> Event: ...

    def current_stream(self) -> object: ...

    def new_stream(self) -> object: ...

    def use(self, stream: object) -> contextlib.AbstractContextManager: ...

    def synchronize(self) -> None: ...


class CudaEvents:
    """The real source: torch.cuda on the current device."""

    def event(self) -> Event:
        return torch.cuda.Event(enable_timing=True)

    def current_stream(self) -> object:
        return torch.cuda.current_stream()

    def new_stream(self) -> object:
        return torch.cuda.Stream()

    def use(self, stream: object) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def _seconds(start: Event, end: Event) -> float:
    return start.elapsed_time(end) / 1e3


class CudaEventTimer:
    method = CUDA_EVENTS

    def __init__(self, source: EventSource | None = None) -> None:
        self.source = source or CudaEvents()
        self._streams: dict[int, object] = {}  # id(group) -> its timing stream
        self._groups: list[object] = []  # the groups keyed, kept alive so that no id is reused
        self._last_end: dict[int, Event] = {}  # id(group) -> the end event of its latest collective
        self._waited: list[_EventSpan] = []

    def start(self, x: torch.Tensor, group: object, blocking: bool, report: Report) -> Span:
        return _EventSpan(self, group, blocking, report)

    def timing_stream(self, group: object) -> object:
        """One per group: NCCL runs a group's collectives in order on one stream, so the ends of its
        collectives come in that order on this one too (one stream for all groups would hold an end
        back behind another group's later one)."""
        if id(group) not in self._streams:
            self._streams[id(group)] = self.source.new_stream()
            self._groups.append(group)
        return self._streams[id(group)]

    def queue_end(self, group: object, end: Event) -> Event | None:
        """`end` is now the latest end on `group`'s stream; returns the one before it, if any."""
        previous, self._last_end[id(group)] = self._last_end.get(id(group)), end
        return previous

    def waited(self, span: _EventSpan) -> None:
        self._waited.append(span)

    def resolve(self) -> None:
        if not self._waited:
            return
        self.source.synchronize()  # once, after the step: every event recorded has happened
        spans, self._waited = self._waited, []
        for span in spans:
            span.resolve()


class _EventSpan:
    def __init__(self, timer: CudaEventTimer, group: object, blocking: bool, report: Report) -> None:
        self.timer, self.group, self.blocking, self.report = timer, group, blocking, report
        source = timer.source
        self.launch = source.event()
        self.launch.record(source.current_stream())
        self.end: Event | None = None  # None: a Work without a future, timed from its wait
        self.previous_end: Event | None = None  # the end of the group's collective before it

    def launched(self, work) -> None:
        try:
            future = work.get_future()
        except RuntimeError:
            return
        source = self.timer.source
        stream = self.timer.timing_stream(self.group)
        self.end = source.event()
        with source.use(stream):
            future.wait()  # this stream waits on the collective's; the host does not
            self.end.record(stream)
        self.previous_end = self.timer.queue_end(self.group, self.end)

    def waiting(self) -> None:
        if not self.blocking:
            self.before = self.timer.source.event()
            self.before.record(self.timer.source.current_stream())

    def waited(self) -> None:
        source = self.timer.source
        self.after = source.event()
        self.after.record(source.current_stream())
        self.timer.waited(self)

    def resolve(self) -> None:
        if self.end is None:  # no end of its own: from its wait (a blocking one: from its launch)
            total = _seconds(self.launch if self.blocking else self.before, self.after)
            self.report(total, total)
            return
        total = _seconds(self.launch, self.end)  # end - max(launch, previous end) = the least of two
        if self.previous_end is not None:
            total = max(min(total, _seconds(self.previous_end, self.end)), 0.0)
        stalled = total if self.blocking else _seconds(self.before, self.after)
        self.report(total, min(max(stalled, 0.0), total))


class CudaEventSteps:
    method = CUDA_EVENTS

    def __init__(
        self, source: EventSource | None = None, host_clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.source, self.host_clock = source or CudaEvents(), host_clock

    def time(self, step: Callable[[], object], sync: Callable[[], None]) -> float:
        """Seconds of one `step` on this rank's compute stream, from before its first op to after its
        last; read after `sync` (the caller's synchronise and barrier), outside the step."""
        sync()
        start, end = self.source.event(), self.source.event()
        start.record(self.source.current_stream())
        step()
        end.record(self.source.current_stream())
        sync()
        return _seconds(start, end)

    def steps(
        self, step: Callable[[], object], sync: Callable[[], None], count: int, between: Callable[[], None]
    ) -> StepTimes:
        """The steps back to back, as training runs them: one `sync` before the first and one after the
        last, an event on the compute stream between each two, so that the host runs ahead into the
        next step while the GPU finishes this one. A step's time is from the event before it to the one
        after it (the GPU idle in between, waiting for a host that issues too slowly, counts); its issue
        time is the host's from the call of `step` to its return. Read after the last `sync`."""
        stream = self.source.current_stream()
        sync()
        marks, issue = [self.source.event()], []
        marks[0].record(stream)
        for _ in range(count):
            start = self.host_clock()
            step()
            issue.append(self.host_clock() - start)
            marks.append(self.source.event())
            marks[-1].record(stream)
            between()
        sync()
        return StepTimes([_seconds(a, b) for a, b in zip(marks[:-1], marks[1:], strict=True)], issue)


def collective_timer(device: torch.device, backend: str) -> CollectiveTimer:
    return CudaEventTimer() if uses_cuda_events(device, backend) else WallClockTimer()


def step_clock(device: torch.device, backend: str) -> StepClock:
    return CudaEventSteps() if uses_cuda_events(device, backend) else WallClockSteps()
