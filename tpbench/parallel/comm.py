"""The collectives of tensor, sequence and vocab parallelism, as conjugate autograd pairs.

| public function                   | forward        | backward       | paper |
|-----------------------------------|----------------|----------------|-------|
| copy_to_tp_region                 | identity       | all-reduce     | f     |
| reduce_from_tp_region             | all-reduce     | identity       | f-bar |
| gather_from_sp_region             | all-gather d0  | reduce-scatter | g     |
| reduce_scatter_to_sp_region       | reduce-scatter | all-gather d0  | g-bar |
| scatter_to_sp_region              | split d0       | all-gather d0  |       |
| gather_from_sp_region_replicated  | all-gather d0  | split d0       |       |

The last two pair a replicated region with the sequence-sharded stream (replicated embedding into SP,
SP into a replicated LM head). Every op is the identity for a group of one.

Every collective goes through `all_reduce`, `all_gather` or `reduce_scatter` below (or their
`*_async` twins, which return a `Pending` to wait on), which report to the active `CommCounter`: count
and per-rank ring bytes on the wire, by op and purpose, an async one the same as its blocking twin;
timed, also its total time and the part of it the caller spent waiting (exposed: a blocking collective
is all exposed), by the counter's `tpbench.parallel.timing` timer: the wall clock on gloo, CUDA events
on NCCL. With `log=True` it keeps each one, in the order issued, as a `CommEvent` (what
`tpbench diagram` draws).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tpbench.parallel import timing
from tpbench.results import CommRow

Group = dist.ProcessGroup | None


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
    """Counts the collectives issued while active. Bytes are per rank on the wire of a ring:
    all-reduce 2(T-1)/T * N, all-gather and reduce-scatter (T-1)/T * N, N the full tensor's bytes.
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
        factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
        wire = round(full_bytes * factor)
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
    global _counter
    previous, _counter = _counter, counter
    try:
        yield counter
    finally:
        _counter = previous


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


_settling = False


@contextlib.contextmanager
def settling() -> Iterator[None]:
    """Each collective returns only once its backend has let go of its tensors, for a memory tracker.

    gloo runs a collective on a worker thread that wakes the caller as soon as the result is ready,
    then drops its own references to the input and output a moment later. When the caller's were the
    other references, the tensor is freed at a moment the thread scheduler chooses: measured here, a
    gathered [S, B, H] freed after the LM head's next op made MemTracker's peak 12.5-14 KB higher on one
    random rank in a few percent of steps (tp 4, SP + VP). Inside, waiting on a collective (a blocking
    one, or `Pending.wait()`) also waits for the worker to drop them (microseconds), so every rank
    frees at the same op.

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


class _Made(TorchDispatchMode):
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


def settle_released(
    tensors: tuple[torch.Tensor, ...], before: tuple[int, ...], made: Sequence[weakref.ref] = ()
) -> None:
    """Until the backend holds no more references to `tensors` than before the collective, and the
    storages its wait made (`made`) are freed, bar the result's."""
    deadline = time.perf_counter() + 1.0  # never hangs: a backend that keeps them longer is let be
    kept = {t.untyped_storage()._cdata for t in tensors}

    def held() -> bool:
        if any(t._use_count() > n for t, n in zip(tensors, before, strict=True)):
            return True
        return any((s := ref()) is not None and s._cdata not in kept for ref in made)

    while held() and time.perf_counter() < deadline:
        time.sleep(0)


def _size(group: Group) -> int:
    """None stands for no group at all (a single process): every op is then the identity."""
    return 1 if group is None else dist.get_world_size(group)


class Pending:
    """A collective in flight. `wait()` returns its result once the backend is done with it; the
    time spent in `wait()` is the collective's exposed time, launch to completion its total time."""

    def __init__(self, result: torch.Tensor, finish=None) -> None:
        self.result, self._finish = result, finish

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self.result


def _launch(
    op: str,
    purpose: str,
    x: torch.Tensor,
    full_bytes: int,
    group: Group,
    fn,
    out: torch.Tensor | None,
    blocking: bool,
) -> Pending:
    """Issue `fn` (a torch.distributed call with async_op=True, returning its Work) and count it
    now, in issue order; timed, its times are reported when it is waited on (the wall clock) or once
    the step is over (CUDA events)."""
    counter = _counter
    purpose = "recompute" if _recomputing else purpose
    held = (x,) if out is None else (x, out)
    settle = _settling and dist.get_backend(group) == "gloo"
    before = tuple(t._use_count() for t in held) if settle else ()
    span = None
    if counter is not None and counter.timed:
        span = counter.timer.start(
            x, group, blocking, lambda total, exposed: counter.add_time(op, purpose, total, exposed)
        )
    # the only reference to the Work, which holds the tensors too: dropped at the wait, before settling
    work = [fn()]
    if span is not None:
        span.launched(work[0])
    if counter is not None:
        if counter.events is None:
            counter.record(op, purpose, full_bytes, _size(group), 0.0, exposed=0.0)
        else:
            ranks = tuple(dist.get_process_group_ranks(group))
            counter.record(
                op, purpose, full_bytes, len(ranks), 0.0, tuple(x.shape), str(x.dtype), ranks, exposed=0.0
            )

    def finish() -> None:
        if span is not None:
            span.waiting()
        made = _Made() if settle else contextlib.nullcontext()
        with made:
            work.pop().wait()
        if settle:
            settle_released(held, before, made.storages)
        if span is not None:
            span.waited()

    return Pending(x if out is None else out, finish)


def all_reduce_bucket(x: torch.Tensor, group: Group, purpose: str) -> tuple[Pending, torch.futures.Future]:
    """DDP's all-reduce of one gradient bucket, from its comm hook (experiments.training), in place:
    counted and timed as `all_reduce_async` is. Returns the Pending, for a timed step to wait on where
    DDP waits, and the future DDP is handed (on the fake backend, one already holding `x`)."""
    works: list[dist.Work] = []

    def fn() -> dist.Work:
        works.append(dist.all_reduce(x, group=group, async_op=True))
        return works[-1]

    if _size(group) == 1:
        pending = Pending(x)
        fn()
    else:
        pending = _launch("all_reduce", purpose, x, x.numel() * x.element_size(), group, fn, None, False)
    if fake_backend(group):  # an emulated rank: the fake work's future holds no value
        future = torch.futures.Future()
        future.set_result(x)
        return pending, future
    return pending, works.pop().get_future().then(lambda fut: fut.value()[0])


def fake_backend(group: Group) -> bool:
    """torch's fake process group: "fake", or bound to one device ("cuda:fake", which an emulated GPU
    rank runs on: tests/fake_cuda_checks.py)."""
    return dist.get_backend(group).split(":")[-1] == "fake"


def timed() -> bool:
    """Whether the active counter times the collectives issued now."""
    return _counter is not None and _counter.timed


# --- raw collectives: the only place tpbench talks to torch.distributed ------------------------


def all_reduce(x: torch.Tensor, group: Group, purpose: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place (out of place while torch.compile traces: use the result)."""
    if _size(group) == 1:
        return x
    if torch.compiler.is_compiling() and op == dist.ReduceOp.SUM:
        return torch.ops.tpbench.all_reduce(x, group.group_name, purpose)
    fn = _all_reduce_fn(x, op, group)
    return _launch("all_reduce", purpose, x, x.numel() * x.element_size(), group, fn, None, True).wait()


def all_reduce_async(x: torch.Tensor, group: Group, purpose: str, op=dist.ReduceOp.SUM) -> Pending:
    """In place, without waiting: `.wait()` before reading x."""
    if _size(group) == 1:
        return Pending(x)
    fn = _all_reduce_fn(x, op, group)
    return _launch("all_reduce", purpose, x, x.numel() * x.element_size(), group, fn, None, False)


def _all_reduce_fn(x: torch.Tensor, op, group: Group):
    return lambda: dist.all_reduce(x, op, group, async_op=True)


def all_gather(x: torch.Tensor, group: Group, purpose: str, site: str = "") -> torch.Tensor:
    """Concatenate the ranks' shards along dim 0. `site` (compiled only) names the caller: inductor
    merges identical ops, so the column linears' gathers of one shard (sp_gather=linear) would become
    one without it."""
    if _size(group) > 1 and torch.compiler.is_compiling():
        return torch.ops.tpbench.all_gather(x, group.group_name, purpose, site)
    return _all_gather(x, group, purpose, blocking=True).wait()


def all_gather_async(x: torch.Tensor, group: Group, purpose: str) -> Pending:
    """all_gather without waiting: `.wait()` returns the gathered tensor."""
    return _all_gather(x, group, purpose, blocking=False)


def _all_gather(x: torch.Tensor, group: Group, purpose: str, blocking: bool) -> Pending:
    world = _size(group)
    if world == 1:
        return Pending(x)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    fn = lambda: dist.all_gather_into_tensor(out, x, group, async_op=True)  # noqa: E731
    return _launch("all_gather", purpose, x, out.numel() * out.element_size(), group, fn, out, blocking)


def reduce_scatter(x: torch.Tensor, group: Group, purpose: str) -> torch.Tensor:
    """Sum over ranks and keep this rank's shard of dim 0."""
    if _size(group) > 1 and torch.compiler.is_compiling():
        return torch.ops.tpbench.reduce_scatter(x, group.group_name, purpose)
    return _reduce_scatter(x, group, purpose, blocking=True).wait()


def reduce_scatter_async(x: torch.Tensor, group: Group, purpose: str) -> Pending:
    """reduce_scatter without waiting: `.wait()` returns this rank's shard."""
    return _reduce_scatter(x, group, purpose, blocking=False)


def _reduce_scatter(x: torch.Tensor, group: Group, purpose: str, blocking: bool) -> Pending:
    world = _size(group)
    if world == 1:
        return Pending(x)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    fn = lambda: dist.reduce_scatter_tensor(out, x, group=group, async_op=True)  # noqa: E731
    return _launch("reduce_scatter", purpose, x, x.numel() * x.element_size(), group, fn, out, blocking)


# --- the same collectives as registered custom ops, for torch.compile (train.compile) --------------
# A compiled graph calls each as an opaque op, with no graph break: the op runs the eager collective
# above, so it is counted, timed and settled exactly as without compile. Out of place: a graph's op
# must not mutate its input.


@torch.library.custom_op("tpbench::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str, purpose: str) -> torch.Tensor:
    return all_reduce(x.clone(), _group(group_name), purpose)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, group_name: str, purpose: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tpbench::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group_name: str, purpose: str, site: str) -> torch.Tensor:
    return all_gather(x, _group(group_name), purpose)


@_all_gather_op.register_fake
def _(x: torch.Tensor, group_name: str, purpose: str, site: str) -> torch.Tensor:
    return x.new_empty((_size(_group(group_name)) * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("tpbench::reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, group_name: str, purpose: str) -> torch.Tensor:
    return reduce_scatter(x, _group(group_name), purpose)


@_reduce_scatter_op.register_fake
def _(x: torch.Tensor, group_name: str, purpose: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] // _size(_group(group_name)), *x.shape[1:]))


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def all_reduce_coalesced(
    tensors: list[torch.Tensor], group: Group, purpose: str, average: bool = False
) -> None:
    """Sum (or average) many tensors over the group in one all-reduce of their concatenation, in place."""
    if not tensors or _size(group) == 1:
        return
    # 1-D tensors (the norms' gradients) as they are: one op fewer each on an emulated rank
    flat = all_reduce(torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors]), group, purpose)
    if average:
        flat /= _size(group)
    pieces = flat.split([t.numel() for t in tensors])  # views of flat, one per tensor
    shaped = [p if t.dim() == 1 else p.view_as(t) for p, t in zip(pieces, tensors, strict=True)]
    torch._foreach_copy_(tensors, shaped)


def world_device() -> torch.device:
    """The device whose tensors the default group's backend takes: CUDA for NCCL (which refuses CPU
    tensors), the CPU for gloo. The same rule torch uses for its object collectives."""
    kind = dist.distributed_c10d._get_object_coll_device()
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def reduce_over_world(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A figure every rank computed, reduced over the whole job (sum, max, ...) for its headline value:
    issued on a copy on `world_device()`, returned on the device it came from. Not counted: it is no
    part of a training step."""
    device = world_device()
    on_backend = x.detach().clone() if x.device.type == device.type else x.detach().to(device)
    dist.all_reduce(on_backend, op)
    return on_backend if x.device.type == device.type else on_backend.to(x.device)


def reduce_floats(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """Python numbers reduced over the whole job, on a float64 tensor of `world_device()`."""
    return reduce_over_world(torch.tensor(values, dtype=torch.float64, device=world_device()), op).tolist()


def split(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's shard of dim 0; no communication. A copy: a view would keep all of `x` alive."""
    world = _size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=0)[dist.get_rank(group)].clone()


# --- conjugate autograd pairs ------------------------------------------------------------------


class Meanwhile(Protocol):
    """Compute a region's entry backward runs while its collective is in flight (parallel.overlap):
    tpbench.parallel.overlap.DeferredWeightGrads."""

    wait: bool  # False only to show that validation catches a gradient read before its sum lands

    def run(self) -> None: ...


def _overlapped(pending: Pending, unreduced: torch.Tensor | None, meanwhile: Meanwhile) -> torch.Tensor:
    meanwhile.run()
    result = pending.wait()
    return result if meanwhile.wait else unreduced


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meanwhile):
        ctx.group, ctx.meanwhile = group, meanwhile
        return x

    @staticmethod
    def backward(ctx, grad):  # a copy: autograd may hand the same gradient to other nodes too
        if ctx.meanwhile is None:
            return all_reduce(grad.clone(), ctx.group, "activation"), None, None
        unreduced = None if ctx.meanwhile.wait else grad.clone()
        pending = all_reduce_async(grad.clone(), ctx.group, "activation")
        return _overlapped(pending, unreduced, ctx.meanwhile), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # in place, as Megatron: x is a row-parallel layer's partial sum that nothing saves (were it
        # saved, its bumped version counter would make that backward fail, never silently differ)
        return all_reduce(x, group, "activation")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meanwhile, site):
        ctx.group, ctx.meanwhile = group, meanwhile
        return all_gather(x, group, "activation", site)

    @staticmethod
    def backward(ctx, grad):
        if ctx.meanwhile is None:
            return reduce_scatter(grad, ctx.group, "activation"), None, None, None
        unreduced = None if ctx.meanwhile.wait else split(grad, ctx.group)
        pending = reduce_scatter_async(grad, ctx.group, "activation")
        return _overlapped(pending, unreduced, ctx.meanwhile), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, "activation")

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, "activation"), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, "activation"), None


class _GatherFromSPReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, "activation")

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: Group, meanwhile: Meanwhile | None = None) -> torch.Tensor:
    """f: identity forward, all-reduce backward. Entering a column-parallel region. With `meanwhile`,
    backward launches the all-reduce, runs `meanwhile` and only then waits for it."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group, meanwhile)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f-bar: all-reduce forward, identity backward. Leaving a row-parallel region."""
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sp_region(
    x: torch.Tensor, group: Group, meanwhile: Meanwhile | None = None, site: str = ""
) -> torch.Tensor:
    """g: all-gather dim 0 forward, reduce-scatter backward. SP shard [S/T] -> TP region [S]. With
    `meanwhile`, backward launches the reduce-scatter, runs `meanwhile` and only then waits for it.
    `site` tells apart entries that gather the same shard (see `all_gather`)."""
    return x if _size(group) == 1 else _GatherFromSP.apply(x, group, meanwhile, site)


def reduce_scatter_to_sp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g-bar: reduce-scatter dim 0 forward, all-gather backward. TP partial sums [S] -> SP shard [S/T]."""
    return x if _size(group) == 1 else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Split dim 0 forward, all-gather backward. A replicated [S] tensor -> its SP shard [S/T]."""
    return x if _size(group) == 1 else _ScatterToSP.apply(x, group)


def gather_from_sp_region_replicated(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather dim 0 forward, split backward. SP shard -> a replicated consumer (full LM head)."""
    return x if _size(group) == 1 else _GatherFromSPReplicated.apply(x, group)


# --- SP: keep the shard, gather again in backward ----------------------------------------------


class Regather:
    """Stands in, in the autograd graph, for a gathered [S, B, H] input saved for backward. Holds
    only the local shard; the first backward use all-gathers it again and the rest share that copy."""

    def __init__(self, shard: torch.Tensor, group: Group):
        self.shard = shard.detach()
        self.group = group
        self.full: torch.Tensor | None = None
        self.pending: Pending | None = None

    def prefetch(self) -> None:
        """Launch the all-gather now; the first use waits for it (parallel.overlap)."""
        if self.full is None and self.pending is None:
            self.pending = all_gather_async(self.shard, self.group, "regather")

    def get(self) -> torch.Tensor:
        if self.full is None:
            self.full = (self.pending or _all_gather(self.shard, self.group, "regather", True)).wait()
            self.pending = None
        return self.full


@contextlib.contextmanager
def saving_only_shard(full: torch.Tensor, shard: torch.Tensor, group: Group) -> Iterator[Regather | None]:
    """Inside, any tensor saved for backward that is (a view of) `full` is saved as the `shard`
    and re-gathered in backward: the paper's TP+SP activation memory (Korthikanti et al. 4.2.2).
    Yields the re-gather, whose `prefetch()` starts it early."""
    if _size(group) == 1:
        yield None
        return
    # the hooks live as long as the graph: they must not hold `full` itself, or nothing is saved
    storage, dtype = full.untyped_storage()._cdata, full.dtype  # a fake tensor has no data_ptr
    token = Regather(shard, group)

    def pack(t: torch.Tensor):
        if t.untyped_storage()._cdata == storage and t.dtype == dtype:
            return token, t.shape, t.stride(), t.storage_offset()
        return t

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        tok, shape, stride, offset = packed
        return tok.get().as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield token
