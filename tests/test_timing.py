"""The CUDA-event timing of collectives and steps (tpbench.parallel.timing) without a GPU: a fake GPU
of simulated streams stands in for torch.cuda, and fake NCCL works for the collectives, launched
through collectives' own `_launch` as tpbench launches them. The fake is NCCL as the timing must take it: a
collective runs on a stream of its own after the compute stream reached its launch; its Work's future
is complete at once (a done callback runs at the launch, on the host); `Future.wait()` and `Work.wait()`
only make the current stream wait for the collective's end; an event can be read only once a
synchronisation has followed its record, as CUDA's `elapsed_time` refuses an event still pending.
The wall clock path on gloo is checked by real ranks (tests/test_parallel.py, async timing)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from tpbench.experiments import throughput
from tpbench.parallel import collectives, instrumentation, timing

MS = 1e-3


class FakeStream:
    def __init__(self, name: str, now: float = 0.0) -> None:
        self.name, self.now = name, now


class FakeEvent:
    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.t, self.order = gpu, None, None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.gpu.current
        self.t, self.order = stream.now, self.gpu.records
        self.gpu.records += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        self.gpu.reads += 1
        if self.order is None or end.order is None or max(self.order, end.order) >= self.gpu.completed:
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.t - self.t) * 1e3


class FakeGPU:
    """The event source: a compute stream, one NCCL stream, and the timer's own streams."""

    def __init__(self) -> None:
        self.compute = FakeStream("compute")
        self.nccl = FakeStream("nccl")
        self.current = self.compute
        self.records = 0  # events recorded so far
        self.completed = 0  # events recorded before the last synchronize
        self.synchronizes = 0
        self.reads = 0  # elapsed_time calls
        self.streams: list[FakeStream] = []

    # the EventSource
    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self) -> FakeStream:
        return self.current

    def new_stream(self) -> FakeStream:
        self.streams.append(FakeStream(f"timing{len(self.streams)}"))
        return self.streams[-1]

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self) -> None:
        self.synchronizes += 1
        self.completed = self.records

    # what the test does on the GPU
    def run(self, seconds: float) -> None:
        """Compute on the current stream."""
        self.current.now += seconds

    def collective(self, seconds: float) -> FakeWork:
        """NCCL's launch: its stream waits for the current one to reach here, then runs the kernel."""
        start = max(self.current.now, self.nccl.now)
        self.nccl.now = start + seconds
        return FakeWork(self, self.nccl.now)


class FakeFuture:
    def __init__(self, gpu: FakeGPU, end: float) -> None:
        self.gpu, self.end = gpu, end

    def done(self) -> bool:
        return True  # NCCL: complete once the kernel is enqueued

    def add_done_callback(self, callback) -> None:
        callback(self)  # at once, on the host, long before the kernel ends

    def wait(self):
        self.gpu.current.now = max(self.gpu.current.now, self.end)
        return [torch.zeros(1)]


class FakeWork:
    def __init__(self, gpu: FakeGPU, end: float, future: bool = True) -> None:
        self.gpu, self.end, self.future = gpu, end, future

    def get_future(self) -> FakeFuture:
        if not self.future:
            raise RuntimeError("this Work has no future")
        return FakeFuture(self.gpu, self.end)

    def wait(self) -> bool:
        self.gpu.current.now = max(self.gpu.current.now, self.end)
        return True


@pytest.fixture
def gpu() -> FakeGPU:
    return FakeGPU()


@pytest.fixture
def counter(gpu):
    counter = instrumentation.CommCounter(timed=True, timer=timing.CudaEventTimer(gpu))
    with instrumentation.counting(counter):
        yield counter


def launch(gpu: FakeGPU, seconds: float, purpose: str, blocking: bool = False, future: bool = True):
    def fn(*_) -> FakeWork:
        work = gpu.collective(seconds)
        work.future = future
        return work

    x = torch.zeros(4)
    return collectives._launch("all_reduce", purpose, x, 16, None, fn, None, blocking)


def times(counter: instrumentation.CommCounter) -> dict[str, tuple[float, float]]:
    return {r.purpose: (round(r.time_s / MS, 9), round(r.exposed_s / MS, 9)) for r in counter.rows()}


def test_a_collective_behind_compute_is_timed_on_its_stream_and_hidden(gpu, counter):
    """2 ms of collective under 5 ms of compute: its total is its 2 ms on NCCL's stream (not 0 ms, the
    host time of the future's callback; not 5 ms, the launch to its wait), none of it exposed."""
    gpu.run(1 * MS)
    pending = launch(gpu, 2 * MS, "hidden")
    gpu.run(5 * MS)
    pending.wait()
    assert times(counter) == {"hidden": (2.0, 0.0)}


def test_the_part_of_a_collective_the_compute_stream_waited_on_is_exposed(gpu, counter):
    pending = launch(gpu, 4 * MS, "partly")
    gpu.run(1 * MS)
    pending.wait()
    assert times(counter) == {"partly": (4.0, 3.0)}
    assert gpu.compute.now == pytest.approx(4 * MS)


def test_a_blocking_collective_is_all_exposed(gpu, counter):
    gpu.run(2 * MS)
    launch(gpu, 3 * MS, "blocking", blocking=True).wait()
    assert times(counter) == {"blocking": (3.0, 3.0)}


def test_a_collective_queued_behind_another_counts_from_when_its_stream_could_start_it(gpu, counter):
    """B waits on NCCL's stream behind A: its time starts where A's ends (end of k minus max(launch
    of k, end of k-1)), so 2 ms and 1 ms of collectives are 3 ms of comm, not 2 + 3 ms, and the
    hidden fraction reads the 0.5 ms of 3 that compute hid (17%), not 50%."""
    a = launch(gpu, 2 * MS, "a")
    b = launch(gpu, 1 * MS, "b")
    gpu.run(0.5 * MS)
    a.wait()
    b.wait()
    assert times(counter) == {"a": (2.0, 1.5), "b": (1.0, 1.0)}
    assert hidden_fraction(counter) == pytest.approx(0.5 / 3)


def test_a_collective_launched_after_the_one_before_ended_counts_from_its_launch(gpu, counter):
    a = launch(gpu, 2 * MS, "a")
    gpu.run(3 * MS)
    a.wait()
    b = launch(gpu, 1 * MS, "b")
    gpu.run(0.5 * MS)
    b.wait()
    assert times(counter) == {"a": (2.0, 0.0), "b": (1.0, 0.5)}


def hidden_fraction(counter: instrumentation.CommCounter) -> float:
    rows = counter.rows()
    return 1 - sum(r.exposed_s for r in rows) / sum(r.time_s for r in rows)


def test_a_work_without_a_future_is_timed_from_its_wait(gpu, counter):
    pending = launch(gpu, 4 * MS, "no_future", future=False)
    gpu.run(1 * MS)
    pending.wait()
    assert times(counter) == {"no_future": (3.0, 3.0)}


def test_nothing_synchronises_or_reads_an_event_inside_the_step(gpu, counter):
    """Events are read once, after the step: one synchronisation, then every elapsed time. The fake
    refuses to read an event no synchronisation followed, as CUDA does."""
    for seconds in (1, 2, 3):
        pending = launch(gpu, seconds * MS, f"c{seconds}")
        gpu.run(1 * MS)
        pending.wait()
    launch(gpu, 1 * MS, "blocking", blocking=True).wait()
    assert (gpu.synchronizes, gpu.reads) == (0, 0)
    first = times(counter)
    assert gpu.synchronizes == 1 and gpu.reads > 0
    assert times(counter) == first and gpu.synchronizes == 1  # read once: not again, not added twice


def test_a_group_has_a_timing_stream_of_its_own(gpu):
    """Two groups' collectives end in their own order: one timing stream for both would hold the
    end of the second group's short collective back behind the first's long one."""
    timer, reported = timing.CudaEventTimer(gpu), {}
    spans = {}
    for group, seconds in (("tp", 5 * MS), ("dp", 1 * MS)):
        gpu.nccl = FakeStream(f"nccl_{group}")  # NCCL: a stream per group
        spans[group] = timer.start(
            torch.zeros(1), group, False, lambda t, e, g=group: reported.update({g: t})
        )
        spans[group].launched(gpu.collective(seconds))
    gpu.run(6 * MS)
    for span in spans.values():
        span.waiting()
        span.waited()
    timer.resolve()
    assert reported == pytest.approx({"tp": 5 * MS, "dp": 1 * MS})
    assert len(gpu.streams) == 2


def test_hidden_fraction_stays_between_0_and_1(gpu, counter):
    rng = random.Random(0)
    for i in range(200):
        blocking = rng.random() < 0.3
        pending = launch(gpu, rng.uniform(0, 3) * MS, f"p{i % 7}", blocking=blocking)
        gpu.run(rng.uniform(0, 3) * MS)
        pending.wait()
    rows = counter.rows()
    assert all(0 <= r.exposed_s <= r.time_s for r in rows)
    total, exposed = sum(r.time_s for r in rows), sum(r.exposed_s for r in rows)
    assert 0 < 1 - exposed / total < 1


def test_a_step_is_timed_between_events_on_the_compute_stream(gpu):
    """The step's time is its compute stream's, read after the caller's synchronisation, which the
    step itself never does."""
    synced_inside: list[int] = []

    def step() -> None:
        gpu.run(7 * MS)
        synced_inside.append(gpu.synchronizes)

    seconds = timing.CudaEventSteps(gpu).time(step, gpu.synchronize)
    assert seconds == pytest.approx(7 * MS)
    assert synced_inside == [1] and gpu.synchronizes == 2  # one before the step, one after


def test_cuda_events_on_nccl_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert timing.uses_cuda_events(cuda, "nccl")
    assert not timing.uses_cuda_events(cuda, "gloo") and not timing.uses_cuda_events(cpu, "gloo")
    assert isinstance(timing.collective_timer(cpu, "gloo"), timing.WallClockTimer)
    assert isinstance(timing.step_clock(cpu, "gloo"), timing.WallClockSteps)
    assert isinstance(instrumentation.CommCounter(timed=True).timer, timing.WallClockTimer)


class Clock:
    """perf_counter on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class HostWork:
    """gloo's Work: its future completes on the worker thread, when the test says."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def get_future(self) -> HostWork:
        return self

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def finish(self) -> None:
        for callback in self.callbacks:
            callback(self)


@pytest.mark.parametrize(
    ("done", "wait", "returned", "expected"),
    [
        (2, 6, 6.1, (2, 0.1)),  # done before the wait: launch to done, hidden but for the wait itself
        (4, 1, 4, (4, 3)),  # done during the wait: its part after the wait began is exposed
        (2, 1, 10, (10, 9)),  # woken 8 ms after done: to the wait's return, never more exposed than total
    ],
)
def test_the_wall_clock_times_from_launch_to_done_or_to_the_wait(monkeypatch, done, wait, returned, expected):
    clock, reported = Clock(), []
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    span = timing.WallClockTimer().start(torch.zeros(1), None, False, lambda t, e: reported.append((t, e)))
    work = HostWork()
    span.launched(work)
    events = sorted([(done, work.finish), (wait, span.waiting), (returned, span.waited)], key=lambda e: e[0])
    for at, call in events:
        clock.now = at * MS
        call()
    ((total, exposed),) = reported
    assert (round(total / MS, 9), round(exposed / MS, 9)) == expected


@pytest.mark.parametrize(
    ("a_done", "b_wait", "b_done", "expected_b"),
    [
        (2, 2, 3, (1, 1)),  # queued behind A on the group's worker: from A's end (2 ms), not its launch
        (2, 6, 6.5, (4.5, 0.5)),  # waited on late (6 ms), done in its wait: from A's end to the return
    ],
)
def test_the_wall_clock_times_a_queued_collective_from_the_end_of_the_one_before(
    monkeypatch, a_done, b_wait, b_done, expected_b
):
    """gloo: A (2 ms) and B launched together on one group; A's wait at 0.5 ms, B's after it."""
    clock, reported = Clock(), {}
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    timer, group = timing.WallClockTimer(), object()
    spans, works = {}, {}
    for name in ("a", "b"):
        spans[name] = timer.start(
            torch.zeros(1), group, False, lambda t, e, n=name: reported.update({n: (t, e)})
        )
        works[name] = HostWork()
        spans[name].launched(works[name])
    events = [
        (0.5, spans["a"].waiting),
        (a_done, works["a"].finish),
        (a_done, spans["a"].waited),
        (b_wait, spans["b"].waiting),
        (b_done, works["b"].finish),
        (b_done, spans["b"].waited),
    ]
    for at, call in sorted(events, key=lambda e: e[0]):  # stable: at a tie, in the order listed
        clock.now = at * MS
        call()
    got = {n: (round(t / MS, 9), round(e / MS, 9)) for n, (t, e) in reported.items()}
    assert got == {"a": (2, 1.5), "b": expected_b}


class Trainer:
    """A training step of one DP gradient collective whose time grows by the step (1, 2, 3 ms)."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.steps = gpu, 0

    def step(self) -> None:
        self.steps += 1
        pending = launch(self.gpu, self.steps * MS, "dp_grads")
        self.gpu.run(1 * MS)
        pending.wait()

    def sync(self) -> None:
        self.gpu.synchronize()


def test_a_throughput_run_times_its_collectives_over_every_timed_step(gpu):
    """The comm rows are the average of the timed steps (2 ms of 1, 2, 3), not one step's."""
    counter = instrumentation.CommCounter(timed=True, timer=timing.CudaEventTimer(gpu))
    trainer = Trainer(gpu)
    times_s = throughput.timed_steps(timing.CudaEventSteps(gpu), trainer, 3, counter).device
    assert times_s == pytest.approx([1 * MS, 2 * MS, 3 * MS])
    ((row,),) = [counter.rows(steps=3)]
    assert (row.count, round(row.time_s / MS, 9), round(row.exposed_s / MS, 9)) == (1, 2.0, 1.0)


# --- the timed window on CUDA: back to back, one synchronise and barrier at each end (issue 57) ------


class HostClock:
    """The host's perf_counter, moved by the steps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_timed_steps_run_back_to_back_with_one_sync_and_barrier_at_each_end(gpu, monkeypatch):
    """The throughput run's window through torch.cuda as the real source calls it (Event,
    current_stream, synchronize patched onto the fake GPU) and the real Trainer.sync (its barrier
    counted): 5 steps, 2 synchronisations and 2 barriers, none between the steps; each step's time
    from the event before it to the one after it."""
    from types import SimpleNamespace

    from tpbench.experiments.training import Trainer as RealTrainer

    barriers: list[int] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(gpu))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: gpu.current)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: gpu.synchronize())
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: barriers.append(gpu.synchronizes))
    steps_seen: list[tuple[int, int]] = []

    class Stepped:
        ctx = SimpleNamespace(device=torch.device("cuda", 0))
        sync = RealTrainer.sync

        def step(self) -> None:
            steps_seen.append((gpu.synchronizes, len(barriers)))
            gpu.run((len(steps_seen) + 1) * MS)

    timed = throughput.timed_steps(timing.CudaEventSteps(), Stepped(), 5, None)
    assert timed.device == pytest.approx([2 * MS, 3 * MS, 4 * MS, 5 * MS, 6 * MS])
    assert steps_seen == [(1, 1)] * 5  # inside the window: no synchronise, no barrier
    assert (gpu.synchronizes, len(barriers)) == (2, 2)


def test_each_step_records_the_hosts_issue_time_beside_the_devices(gpu):
    """The host takes 3 ms to enqueue a step the GPU runs in 7 ms: issue 3 ms, step 7 ms, not
    host-bound; 6.5 of 7 ms is."""
    host = HostClock()

    def step() -> None:
        host.now += 3 * MS
        gpu.run(7 * MS)

    timed = timing.CudaEventSteps(gpu, host).steps(step, gpu.synchronize, 3, lambda: None)
    assert timed.issue == pytest.approx([3 * MS] * 3)
    assert timed.device == pytest.approx([7 * MS] * 3)
    assert not timing.host_bound(3 * MS, 7 * MS)
    assert timing.host_bound(6.5 * MS, 7 * MS) and not timing.host_bound(6.2 * MS, 7 * MS)


def test_the_wall_clock_times_each_step_between_barriers_and_issues_nothing():
    """On a CPU the host's time is the step: barrier to barrier around each, no issue time apart."""
    syncs: list[str] = []
    timed = timing.WallClockSteps().steps(lambda: syncs.append("step"), lambda: syncs.append("sync"), 2,
                                          lambda: None)  # fmt: skip
    assert syncs == ["sync", "step", "sync"] * 2
    assert len(timed.device) == 2 and timed.issue == []


def test_prefetched_batches_are_the_drawn_ones_copied_pinned_without_blocking(monkeypatch):
    """Batches.prefetch on a GPU: the same batches in the same order as drawn one by one, each copied
    from pinned memory with non_blocking; on a CPU it does nothing."""
    from types import SimpleNamespace

    from tpbench.config import RunConfig
    from tpbench.experiments.setup import Batches

    ctx = SimpleNamespace(dp=2, dp_rank=0, device=torch.device("cpu"))
    expected = Batches(RunConfig(), ctx)
    drawn = [expected.next_global() for _ in range(3)]
    on_cpu = Batches(RunConfig(), ctx)
    on_cpu.prefetch(3)
    assert not on_cpu._ready

    copies: list[tuple[bool, bool]] = []
    pin, to = torch.Tensor.pin_memory, torch.Tensor.to

    def pinned(t):
        out = t.clone()
        out.pinned = True
        return out

    def copied(t, *args, non_blocking=False, **kwargs):
        if args and getattr(args[0], "type", None) == "cuda":
            copies.append((getattr(t, "pinned", False), non_blocking))
            return t.clone()
        return to(t, *args, non_blocking=non_blocking, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pinned)
    monkeypatch.setattr(torch.Tensor, "to", copied)
    gpu_batches = Batches(RunConfig(), ctx)
    gpu_batches.device = torch.device("cuda", 0)
    gpu_batches.prefetch(3)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    assert copies == [(True, True)] * 6  # ids and labels of 3 batches
    for ids, labels in drawn:
        got_ids, got_labels = gpu_batches.next_global()
        assert torch.equal(got_ids, ids) and torch.equal(got_labels, labels)
