"""The raw collectives: the only place tpbench talks to torch.distributed.

`all_reduce`, `all_gather` and `reduce_scatter`, and their `*_async` twins, which return a `Pending`
to wait on; every one is the identity for a group of one (`group_size` 1). Each goes through
`_launch`, which reports it to the active counter of `tpbench.parallel.instrumentation` (counted,
timed, settled: see there). While torch.compile traces, and inside `as_custom_ops` (per-op
recompute), the blocking ones go through the registered custom ops below, which run the same eager
collectives. Built on them: `all_reduce_coalesced`, DDP's
`all_reduce_bucket`, and the whole job's `reduce_over_world` / `reduce_floats` for headline figures
(not counted). The conjugate autograd pairs that use them are in `tpbench.parallel.regions`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from tpbench.parallel import instrumentation

Group = dist.ProcessGroup | None

# torch 2.12 named these all_gather_single and reduce_scatter_single (2.13 deprecates the old names with
# a FutureWarning); an older torch, such as the 2.11 of a GPU image (benchmarks/gpu-check.sh), has only
# all_gather_into_tensor and reduce_scatter_tensor, the same collectives.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
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
    stage: bool = True,
) -> Pending:
    """Issue `fn(x, out)` (a torch.distributed call with async_op=True on those tensors, returning its
    Work) and count it now, in issue order; timed, its times are reported when it is waited on (the
    wall clock) or once the step is over (CUDA events).

    Under instrumentation.settling over gloo (a memory run), gloo's worker thread is handed staging
    copies that no memory tracker sees, never the caller's tensors: the result is copied into x (or
    out) at the wait, on the caller's thread. Handed the caller's tensors, the worker sometimes let go
    of one after the caller had (`_copy_back` says how), so that a tensor the caller dropped was freed on
    that thread at a moment of its own: the peak of one random rank a tensor higher. `stage=False`
    (DDP's buckets, whose future DDP reads) keeps the caller's tensors and settles them instead."""
    counter = instrumentation.active_counter()
    purpose = instrumentation.counted_purpose(purpose)
    on_gloo = instrumentation.is_settling() and dist.get_backend(group) == "gloo"
    staged, settle = on_gloo and stage, on_gloo and not stage
    if staged:
        with untracked():  # the staging copies: no tracker sees them made or freed
            run_x, run_out = x.clone(), None if out is None else torch.empty_like(out)
    else:
        run_x, run_out = x, out
    held = (x,) if out is None else (x, out)
    before = instrumentation.references(held) if settle else ()
    span = None
    if counter is not None and counter.timed:
        span = counter.timer.start(
            x, group, blocking, lambda total, exposed: counter.add_time(op, purpose, total, exposed)
        )
    # the only reference to the Work, which holds the tensors too: dropped at the wait, before settling.
    # Staged, the c10d op is untracked too: a tracker sees the op's outputs (the staging copies).
    with untracked() if staged else contextlib.nullcontext():
        work = [fn(run_x, run_out)]
    if span is not None:
        span.launched(work[0])
    if counter is not None:
        if counter.events is None:
            counter.record(op, purpose, full_bytes, group_size(group), 0.0, exposed=0.0)
        else:
            ranks = tuple(dist.get_process_group_ranks(group))
            counter.record(
                op, purpose, full_bytes, len(ranks), 0.0, tuple(x.shape), str(x.dtype), ranks, exposed=0.0
            )

    def finish() -> None:
        if span is not None:
            span.waiting()
        if staged:
            with untracked():  # gloo's reduce-scatter copies this rank's chunk out in its wait()
                work.pop().wait()
            _copy_back(x, out, run_x, run_out)
        else:
            made = instrumentation.MadeStorages() if settle else contextlib.nullcontext()
            with instrumentation.waiting() if settle else contextlib.nullcontext():
                with made:
                    work.pop().wait()
                if settle:
                    instrumentation.settle_released(held, before, made.storages)
        if span is not None:
            span.waited()

    return Pending(x if out is None else out, finish)


def untracked() -> contextlib.AbstractContextManager:
    """Ops that no dispatch mode (a memory tracker) sees: the staging copies of `_launch` and of
    memory.PeakTracker's functional collectives."""
    return torch.utils._python_dispatch._disable_current_modes()


def _copy_back(
    x: torch.Tensor, out: torch.Tensor | None, run_x: torch.Tensor, run_out: torch.Tensor | None
) -> None:
    """A staged collective's result into the caller's tensor, as the collective would have left it:
    an in-place all-reduce leaves x's version counter alone (gloo's does), an out tensor's is bumped
    once (as gloo's gather into it does).

    Why staged (`_launch`): with the caller's own tensor, in 2-10 of 3,000 all-reduces of a fresh
    [64, 2, 64] bf16 tensor (2 ranks, the 2-core machine loaded) gloo's worker still held its
    TensorImpl just after every count of references to it (tensor and storage, strong and weak) had
    come back to what it was before the collective; the caller's `del` then left the tensor alive,
    to be freed on the worker thread later (the memory tracker's `memory_late_frees`: 16 KB on one
    rank at the final norm's backward in one CI run of T 4, VP). No count tells when the worker is
    done; a copy it holds instead is one no tracker sees."""
    if out is None:
        with torch.autograd._unsafe_preserve_version_counter(x):
            x.copy_(run_x)
    else:
        out.copy_(run_out)


# --- the collectives ----------------------------------------------------------------------------


_as_ops = False


@contextlib.contextmanager
def as_custom_ops():
    """Inside, the blocking collectives go through the registered custom ops below, as while
    torch.compile traces: each is one op that a dispatch mode sees, none of its internals. Per-op
    recompute (tpbench.parallel.recompute, train.recompute=op) runs a block's forward in it, so that
    its policy saves each collective's output and the recomputation in backward communicates nothing."""
    global _as_ops
    previous, _as_ops = _as_ops, True
    try:
        yield
    finally:
        _as_ops = previous


def _through_ops() -> bool:
    return _as_ops or torch.compiler.is_compiling()


def all_reduce(x: torch.Tensor, group: Group, purpose: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place (out of place while torch.compile traces, or `as_custom_ops`: use the result)."""
    if group_size(group) == 1:
        return x
    if _through_ops() and op == dist.ReduceOp.SUM:
        return torch.ops.tpbench.all_reduce(x, group.group_name, purpose)
    return _all_reduce(x, group, purpose, op)


def _all_reduce(x: torch.Tensor, group: Group, purpose: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    fn = _all_reduce_fn(x, op, group)
    return _launch("all_reduce", purpose, x, x.numel() * x.element_size(), group, fn, None, True).wait()


def all_reduce_async(x: torch.Tensor, group: Group, purpose: str, op=dist.ReduceOp.SUM) -> Pending:
    """In place, without waiting: `.wait()` before reading x."""
    if group_size(group) == 1:
        return Pending(x)
    fn = _all_reduce_fn(x, op, group)
    return _launch("all_reduce", purpose, x, x.numel() * x.element_size(), group, fn, None, False)


def _all_reduce_fn(x: torch.Tensor, op, group: Group):
    return lambda a, _: dist.all_reduce(a, op, group, async_op=True)


def all_gather(x: torch.Tensor, group: Group, purpose: str, site: str = "") -> torch.Tensor:
    """Concatenate the ranks' shards along dim 0. `site` (compiled only) names the caller: inductor
    merges identical ops, so the column linears' gathers of one shard (sp_gather=linear) would become
    one without it."""
    if group_size(group) > 1 and _through_ops():
        return torch.ops.tpbench.all_gather(x, group.group_name, purpose, site)
    return _all_gather(x, group, purpose, blocking=True).wait()


def all_gather_async(x: torch.Tensor, group: Group, purpose: str) -> Pending:
    """all_gather without waiting: `.wait()` returns the gathered tensor."""
    return _all_gather(x, group, purpose, blocking=False)


def _all_gather(x: torch.Tensor, group: Group, purpose: str, blocking: bool) -> Pending:
    world = group_size(group)
    if world == 1:
        return Pending(x)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    fn = lambda a, o: all_gather_single(o, a, group, async_op=True)  # noqa: E731
    return _launch("all_gather", purpose, x, out.numel() * out.element_size(), group, fn, out, blocking)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Group, purpose: str) -> torch.Tensor:
    """all_gather into a given flat `out` (world * x.numel() elements; a persistent buffer: ZeRO's
    parameter buffer), blocking."""
    if group_size(group) == 1:
        return out.copy_(x.reshape(out.shape))
    x = x.contiguous()
    fn = lambda a, o: all_gather_single(o, a, group, async_op=True)  # noqa: E731
    return _launch("all_gather", purpose, x, out.numel() * out.element_size(), group, fn, out, True).wait()


def all_gather_into_async(out: torch.Tensor, x: torch.Tensor, group: Group, purpose: str) -> Pending:
    """all_gather_into without waiting (ZeRO-1's bucket of the parameter buffer, `x` this rank's
    slice of `out`: in place, as Megatron's distributed optimizer gathers): `.wait()` before reading out."""
    if group_size(group) == 1:
        return Pending(out.copy_(x.reshape(out.shape)))
    fn = lambda a, o: all_gather_single(o, a, group, async_op=True)  # noqa: E731
    return _launch("all_gather", purpose, x, out.numel() * out.element_size(), group, fn, out, False)


def reduce_scatter_into_async(out: torch.Tensor, x: torch.Tensor, group: Group, purpose: str) -> Pending:
    """reduce_scatter of a flat `x` into a given `out` (ZeRO-1's bucket of the gradient buffer, `out`
    this rank's slice of it: in place, as Megatron's distributed optimizer reduce-scatters), without
    waiting: `.wait()` before reading out."""
    if group_size(group) == 1:
        return Pending(out.copy_(x.reshape(out.shape)))
    fn = lambda a, o: reduce_scatter_single(o, a, group=group, async_op=True)  # noqa: E731
    return _launch("reduce_scatter", purpose, x, x.numel() * x.element_size(), group, fn, out, False)


def reduce_scatter(x: torch.Tensor, group: Group, purpose: str) -> torch.Tensor:
    """Sum over ranks and keep this rank's shard of dim 0."""
    if group_size(group) > 1 and _through_ops():
        return torch.ops.tpbench.reduce_scatter(x, group.group_name, purpose)
    return _reduce_scatter(x, group, purpose, blocking=True).wait()


def reduce_scatter_async(x: torch.Tensor, group: Group, purpose: str) -> Pending:
    """reduce_scatter without waiting: `.wait()` returns this rank's shard."""
    return _reduce_scatter(x, group, purpose, blocking=False)


def _reduce_scatter(x: torch.Tensor, group: Group, purpose: str, blocking: bool) -> Pending:
    world = group_size(group)
    if world == 1:
        return Pending(x)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    fn = lambda a, o: reduce_scatter_single(o, a, group=group, async_op=True)  # noqa: E731
    return _launch("reduce_scatter", purpose, x, x.numel() * x.element_size(), group, fn, out, blocking)


# --- the same collectives as registered custom ops, for torch.compile (train.compile) --------------
# A compiled graph calls each as an opaque op, with no graph break: the op runs the eager collective
# above, so it is counted, timed and settled exactly as without compile. Out of place: a graph's op
# must not mutate its input.


@torch.library.custom_op("tpbench::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str, purpose: str) -> torch.Tensor:
    return _all_reduce(x.clone(), _group(group_name), purpose)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, group_name: str, purpose: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tpbench::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group_name: str, purpose: str, site: str) -> torch.Tensor:
    return _all_gather(x, _group(group_name), purpose, blocking=True).wait()


@_all_gather_op.register_fake
def _(x: torch.Tensor, group_name: str, purpose: str, site: str) -> torch.Tensor:
    return x.new_empty((group_size(_group(group_name)) * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("tpbench::reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, group_name: str, purpose: str) -> torch.Tensor:
    return _reduce_scatter(x, _group(group_name), purpose, blocking=True).wait()


@_reduce_scatter_op.register_fake
def _(x: torch.Tensor, group_name: str, purpose: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] // group_size(_group(group_name)), *x.shape[1:]))


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


# --- built on them: many tensors in one, DDP's buckets -----------------------------------------


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    group: Group,
    purpose: str,
    average: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    """Sum (or average) many tensors over the group in one all-reduce of their concatenation, in place.
    dtype: the all-reduce's, the tensors' own if None (debug.low_precision_reduce: the compute dtype)."""
    if not tensors or group_size(group) == 1:
        return
    # 1-D tensors (the norms' gradients) as they are: one op fewer each on an emulated rank
    flat = torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors])
    flat = all_reduce(flat if dtype is None else flat.to(dtype), group, purpose)
    if average:
        flat /= group_size(group)
    pieces = flat.split([t.numel() for t in tensors])  # views of flat, one per tensor
    shaped = [p if t.dim() == 1 else p.view_as(t) for p, t in zip(pieces, tensors, strict=True)]
    torch._foreach_copy_(tensors, shaped)


def all_reduce_bucket(x: torch.Tensor, group: Group, purpose: str) -> tuple[Pending, torch.futures.Future]:
    """DDP's all-reduce of one gradient bucket, from its comm hook (experiments.training), in place:
    counted and timed as `all_reduce_async` is. Returns the Pending, for a timed step to wait on where
    DDP waits, and the future DDP is handed (on the fake backend, one already holding `x`)."""
    works: list[dist.Work] = []

    def fn(a: torch.Tensor, _) -> dist.Work:
        works.append(dist.all_reduce(a, group=group, async_op=True))
        return works[-1]

    if group_size(group) == 1:
        pending = Pending(x)
        fn(x, None)
    else:  # not staged: DDP reads the bucket through the future
        pending = _launch(
            "all_reduce", purpose, x, x.numel() * x.element_size(), group, fn, None, False, False
        )
    if fake_backend(group):  # an emulated rank: the fake work's future holds no value
        future = torch.futures.Future()
        future.set_result(x)
        return pending, future
    return pending, works.pop().get_future().then(lambda fut: fut.value()[0])


def fake_backend(group: Group) -> bool:
    """torch's fake process group: "fake", or bound to one device ("cuda:fake", which an emulated GPU
    rank runs on: tests/fake_cuda_checks.py)."""
    return dist.get_backend(group).split(":")[-1] == "fake"


def launch_counted(op: str, x: torch.Tensor, out: torch.Tensor, group: Group, purpose: str, fn) -> Pending:
    """Another library's collective (FSDP2's all-gather or reduce-scatter of `x` into `out`, `fn(x, out)`
    issuing it on the tensors it is given with async_op=True), counted and timed as ours: the full
    tensor is the larger one."""
    full = max(x.numel() * x.element_size(), out.numel() * out.element_size())
    return _launch(op, purpose, x, full, group, fn, out, False)


# --- over the whole job, for headline figures ---------------------------------------------------


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
