"""One process stands in for any rank of any job: rank emulation on torch's fake process group.

`launch.emulate=real|fake` runs rank r (`launch.emulate_rank`, default the busiest) of a tp x dp job in
one process, on `torch.testing._internal.distributed.fake_pg`: every collective is a no-op that leaves
its output the right shape, so the rank allocates, and counts, exactly what it would in the real job;
the values it computes are not the job's.

  real   real tensors on this machine's device: the rank's true per-category memory (MemTracker), and
         on a GPU its allocator peaks. The compute runs, so a big model needs the memory it measures.
  fake   FakeTensorMode: tensors carry shapes, dtypes and storage sizes but no data, so no compute
         runs and any shape fits (H 8192, L 64, T 64 in seconds). Peaks equal real tensors' byte for
         byte (tests/test_emulation.py holds it).

Emulating a GPU rank without a GPU (`launch.device=cuda launch.emulate=fake`). On a CPU-only torch,
fake tensors on device "cuda" run a forward only: autograd cannot record a graph on them, and
copy_, strided copies and Python indexing abort, all for want of CUDA's device guard (a CUDA build of
torch without a GPU fails the same way, and a C++ guard shim still leaves autograd's accelerator
check). Fake CPU tensors run the whole step, and the kernels that differ between the devices save the
same tensors: the CPU flash-attention kernel saves what the CUDA one does (q, k, v, output and an
fp32 logsumexp), to the 512-byte rounding the allocator model applies. So a GPU rank is emulated on
fake CPU tensors with the GPU's own choices made explicitly: AdamW's foreach path (CUDA's default)
with its step counters on the host, torch DDP as configured, and the allocator's view of the trace
(tpbench.predict.allocator: 512-byte rounding, 2 and 20 MiB segments, block splitting, cuBLAS workspaces).
What this cannot tell: time, bandwidth, and autocast's CUDA cast lists (precision=mixed emulates
with the CPU's).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._pytree import tree_leaves

from tpbench.config import RunConfig, world_size

try:  # FakeTensorMode's private cache and device internals (torch 2.13), behind FakeRank's quick key
    from torch._subclasses._fake_tensor_utils import _CacheKeyState
    from torch._subclasses.fake_tensor import (
        _DISPATCH_HANDLE_DIRECTLY,
        _DISPATCH_META_HANDLERS,
        FakeTensorConfig,
        _BypassDispatchCache,
        _device_handler,
        _DispatchCacheBypassEntry,
        _DispatchCacheValidEntry,
    )

    QUICK = True
except ImportError:  # another torch: FakeRank takes FakeTensorMode's own path, slower, same tensors
    QUICK = False


def _is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor: none exists before torch.distributed.tensor is imported, so a run without the dtensor
    engine never imports it for this check (DTensor's op registrations: about 0.4 s of each process)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def emulated(cfg: RunConfig) -> bool:
    return cfg.launch.emulate != "none"


def emulated_rank(cfg: RunConfig) -> int:
    """launch.emulate_rank, by default rank 0: the busiest, as every rank holds the same shapes (TP
    shards are equal, DP replicas are equal, a replicated KV head is one head on every rank, and under
    VP with a padded vocabulary the ranks holding padded rows mask them in the loss's one fp32 buffer,
    in place)."""
    r = cfg.launch.emulate_rank
    return 0 if r is None else r


def init_process_group(cfg: RunConfig) -> None:
    """Join a job of tp x dp ranks as the emulated rank, alone: torch's fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=emulated_rank(cfg), world_size=world_size(cfg))


Observer = Callable[[torch._ops.OpOverload, object], None]
_UNCACHED = object()  # FakeRank's entry for an op whose output FakeTensorMode does not cache
_SCALAR_VALUES: dict = {}  # op -> whether its key holds the values of a list of floats (see _describe)
_DEVICE = torch.ops.prim.device.default
_ITEM = torch.ops.aten._local_scalar_dense.default
_PLAIN = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


class FakeRank(FakeTensorMode):
    """FakeTensorMode made fast enough for a 64-layer model, with the same tensors out of every op.

    Observers: it shows the outputs of every op to its observers (the allocation trace, the memory
    tracker) itself. As dispatch modes of their own above it, each observer cost every op a trip
    through Python, and most ops are autograd asking a fake tensor for its device (prim.device, 700 a
    layer and step; answered here without FakeTensorMode's set-up, as is AdamW's `item()` of its step
    counters, 7 a parameter and step, constants whose value FakeTensorMode keeps): here they see
    the same ops in the same order, when each returns. Ops that
    FakeTensorMode runs inside an op (decompositions) are not shown, as no mode above it saw them.

    Cache: FakeTensorMode caches each op's output metadata under a key it builds from every field of
    every argument's metadata, which costs more than the rest of the op. Here a cheaper key made of
    the same facts (the op; the default dtype and device, inference mode, tracing; each argument's
    dtype, shape, strides, device, storage offset and size, requires_grad, conj/neg/inference/quantized
    bits, or its type and value) leads to the key FakeTensorMode built the first time and its entry.
    On a hit, outputs that are new tensors or a view op's are made from recipes read off that entry
    once (`_recipes`), as FakeTensorMode would make them from it; any other output (an argument
    handed back) FakeTensorMode makes from its entry as on its own hits. Ops with a list of tensors
    out (the foreach ops of AdamW, split, unbind), which FakeTensorMode does not cache, get an entry
    made here by FakeTensorMode's own rules for a tuple out; ops it will not cache go straight to its
    dispatch, without building its key to find that out again; on a miss FakeTensorMode's key is
    built once (its own look-up is done here). The in-place foreach ops' lists of floats (AdamW's
    bias corrections, new every step) enter the quick key by their length: such an op returns
    nothing and changes no tensor's metadata, whatever the numbers. Arguments the key does not
    describe (constants, other modes' or symbolic tensors, anything not plain) go the whole way."""

    def __init__(self) -> None:
        super().__init__()
        self._observers: list[Observer] = []
        self._depth = 0  # FakeTensorMode re-enters itself for decompositions
        # quick key -> (FakeTensorMode's key, its entry, whether a list out, recipes) or _UNCACHED
        self._entries: dict[tuple, tuple | object] = {}
        self._fresh_state: dict | None = None  # what FakeTensor.__new__ sets on a fresh fake tensor

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No Dynamo guard around every op: nothing here is compiled (torch's documented opt-out)."""
        return False

    def __enter__(self) -> FakeRank:
        _hide_dtensor_shape_inference(+1)
        return super().__enter__()

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        _hide_dtensor_shape_inference(-1)

    @contextlib.contextmanager
    def observed_by(self, observer: Observer) -> Iterator[None]:
        self._observers.append(observer)
        try:
            yield
        finally:
            self._observers.remove(observer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if QUICK and func is _DEVICE:  # answered as FakeTensorMode answers it, without its set-up
            out = _device_handler(args)
        elif func is _ITEM and type(args[0]) is FakeTensor and args[0].constant is not None:
            out = args[0].constant.item()  # as FakeTensorMode answers it: from the constant it keeps
        else:
            self._depth += 1
            try:
                out = self._cached(func, types, args, kwargs or {})
            finally:
                self._depth -= 1
        if self._depth == 0:
            for observe in self._observers:
                observe(func, out)
        return out

    def _cached(self, func, types, args, kwargs):
        key = self._quick_key(func, args, kwargs) if QUICK else None
        if key is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        found = self._entries.get(key)
        if found is _UNCACHED:  # FakeTensorMode would build its key only to find it bypasses
            return self._dispatch_impl(func, types, args, kwargs)
        state = _CacheKeyState(self.shape_env)
        if found is not None:
            full_key, entry, as_list, recipes = found
            FakeTensorMode.cache_hits += 1
            if recipes is not None:  # new tensors and views' outputs, made from the entry's recipes
                fresh = [self._fresh(args, *recipe) for recipe in recipes]
                return fresh if as_list else tuple(fresh) if entry.is_output_tuple else fresh[0]
            out = self._output_from_cache_entry(state, entry, full_key, func, args)
            return list(out) if as_list else out
        try:  # FakeTensorMode's key, made before the op can change its arguments
            full_key = self._cache_key(state, func, args, kwargs)
        except _BypassDispatchCache:
            return super().__torch_dispatch__(func, types, args, kwargs)
        # FakeTensorMode's own look-up (_cached_dispatch_impl), with the key built once
        entry = FakeTensorMode.cache.get(full_key)
        if isinstance(entry, _DispatchCacheValidEntry):
            FakeTensorMode.cache_hits += 1
            self._entries[key] = (full_key, entry, False, self._recipes(func, entry))
            return self._output_from_cache_entry(state, entry, full_key, func, args)
        out = self._dispatch_impl(func, types, args, kwargs)
        if entry is None:
            try:
                entry = self._make_cache_entry(state, full_key, func, args, kwargs, out)
                FakeTensorMode.cache_misses += 1
            except _BypassDispatchCache as e:
                entry = _DispatchCacheBypassEntry(e.reason)
            FakeTensorMode.cache[full_key] = entry
        if isinstance(entry, _DispatchCacheValidEntry):
            self._entries[key] = (full_key, entry, False, self._recipes(func, entry))
        else:
            self._entries[key] = self._list_entry(full_key, func, args, kwargs, out)
        return out

    def _list_entry(self, full_key, func, args, kwargs, out) -> tuple | object:
        """A list of tensors out (the foreach ops, split, unbind): FakeTensorMode caches tuples only,
        so the entry is made here as FakeTensorMode makes a tuple's, each tensor checked by its rules."""
        if type(out) is not list or not all(type(t) is FakeTensor for t in out):
            return _UNCACHED
        given = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if any(id(t) in given for t in out):  # an argument handed back: the entry would copy it
            return _UNCACHED
        try:
            state = _CacheKeyState(self.shape_env)
            entry = self._make_cache_entry(state, full_key, func, args, kwargs, tuple(out))
        except _BypassDispatchCache:
            return _UNCACHED
        return (full_key, entry, True, self._recipes(func, entry))

    def _recipes(self, func, entry: _DispatchCacheValidEntry) -> tuple | None:
        """How `_fresh` makes each output on a hit as FakeTensorMode would (its
        `_get_output_tensor_from_cache_entry`, then `FakeTensor.__new__`), without the checks both
        repeat on every hit (they took 30% of a 64-layer step): for outputs of plain metadata on the
        CPU, new or a view op's (on its argument's storage). None for anything else (an argument
        handed back, symbolic sizes, a conj/neg bit, another device): FakeTensorMode's own way."""
        if FakeTensorConfig.debug:
            return None
        view = isinstance(func, torch._ops.OpOverload) and func.is_view
        recipes = []
        for info in entry.output_infos:
            m = info.metadata
            if info.inplace_idx is not None or m is None or (view and info.view_idx is None):
                return None
            if m.layout is not torch.strided or m.is_conj or m.is_neg or m.device.type != "cpu":
                return None
            if not all(type(v) is int for v in (*m.shape, *m.stride, m.storage_offset)):
                return None
            state = {**self._fresh_attributes(), "_fake_device": m.device}
            on = (info.view_idx, m.storage_offset) if view else None
            recipes.append((tuple(m.shape), tuple(m.stride), m.dtype, m.requires_grad, state, on))
        return tuple(recipes)

    def _fresh_attributes(self) -> dict:
        """The attributes FakeTensor.__new__ gives a new fake tensor of this mode, read off one it made."""
        if self._fresh_state is None:
            self._fresh_state = vars(FakeTensor(self, torch.empty(0, device="meta"), torch.device("cpu")))
        return self._fresh_state

    def _fresh(self, args, shape, stride, dtype, requires_grad, state, on) -> FakeTensor:
        """A fake tensor as FakeTensor.__new__ makes it: a meta tensor (on the storage of argument
        `on[0]` at offset `on[1]` for a view op), wrapped with the fake device's dispatch keys, its
        mutable data pointer guarded as the mode says, the attributes of `_fresh_attributes`."""
        with torch._C._DisableTorchDispatch():
            meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
            if on is not None:
                meta.set_(args[on[0]].untyped_storage(), on[1], shape, stride)
        device = state["_fake_device"]
        t = torch.Tensor._make_subclass(FakeTensor, meta, requires_grad, dispatch_device=True,
                                        device_for_backend_keys=device)  # fmt: skip
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        else:
            torch._C._set_throw_on_mutable_data_ptr(t)
        t.__dict__.update(state)
        return t

    def _quick_key(self, func, args, kwargs) -> tuple | None:
        if self.in_kernel_invocation or not self.cache_enabled or self.shape_env is not None:
            return None
        if func in _DISPATCH_META_HANDLERS or func in _DISPATCH_HANDLE_DIRECTLY:  # never cached
            return None
        if (values := _SCALAR_VALUES.get(func)) is None:
            name = func._schema.name if isinstance(func, torch._ops.OpOverload) else ""
            values = _SCALAR_VALUES[func] = not (name.startswith("aten::_foreach_") and name.endswith("_"))
        facts = [
            func,
            torch.get_default_dtype(),
            torch._C._get_default_device(),
            torch.is_inference_mode_enabled(),
            get_proxy_mode() is not None,
        ]
        if not (
            self._describe(facts, args, values)
            and self._describe(facts, tuple(kwargs))
            and self._describe(facts, tuple(kwargs.values()), values)
        ):
            return None
        return tuple(facts)

    def _describe(self, facts: list, values: Iterable, scalar_values: bool = True) -> bool:
        """Append each value's facts; False for one it cannot describe. Without `scalar_values` (an
        in-place foreach op: it returns nothing and changes no tensor's metadata, whatever the
        numbers), a list of Python floats (AdamW's bias corrections, new every step) is its length."""
        for v in values:
            if type(v) is FakeTensor:
                if v.fake_mode is not self or v.constant is not None or v.layout is not torch.strided:
                    return False
                facts.append(
                    (
                        v.dtype,
                        v.shape,
                        v.stride(),
                        v.device,
                        v.storage_offset(),
                        v.untyped_storage().nbytes(),
                        v.requires_grad,
                        v.is_conj(),
                        v.is_neg(),
                        v.is_inference(),
                        v.is_quantized,
                    )
                )
            elif not scalar_values and type(v) is list and v and all(type(x) is float for x in v):
                facts.append((list, float, len(v)))
            elif type(v) in (list, tuple, torch.Size):
                facts.append((type(v), len(v)))
                if not self._describe(facts, v):
                    return False
            elif type(v) in _PLAIN:
                facts.append((type(v), v))
            else:
                return False
        return True


_shape_inference: list = [0, None]  # FakeRanks entered; ShardingPropagator's own method while patched


def _hide_dtensor_shape_inference(entered: int) -> None:
    """While a FakeRank is entered, DTensor's shape inference (ShardingPropagator's
    `_propagate_tensor_meta_non_cached`, which runs an op at its global shape to learn its output's)
    runs with no dispatch mode on: in a fresh FakeTensorMode, as it does beside real tensors. Under a
    FakeRank it found the FakeRank and ran there, where the memory tracker counted what it made: on a
    device, at the global shape, though no rank allocates it (loss_parallel's backward infers its
    output's shape so: two fp32 [N, V], 6.2 MiB over real tensors on the CPU preset's TP+SP+VP,
    docs/results/dtensor.md)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    count, original = _shape_inference
    if entered > 0 and count == 0:
        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def unseen(self, op_schema):
            with torch.utils._python_dispatch._disable_current_modes():
                return original(self, op_schema)

        ShardingPropagator._propagate_tensor_meta_non_cached = unseen
    elif entered < 0 and count == 1:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
        original = None
    _shape_inference[:] = [count + entered, original]


def tensor_mode(cfg: RunConfig) -> FakeRank | contextlib.AbstractContextManager:
    """Where the rank's tensors are made: FakeRank (a FakeTensorMode) for the fake flavour."""
    return FakeRank() if cfg.launch.emulate == "fake" else contextlib.nullcontext()


def gpu_emulated(cfg: RunConfig) -> bool:
    """A GPU rank emulated on the CPU (see the module's docstring)."""
    return cfg.launch.device == "cuda" and cfg.launch.emulate == "fake"


class AllocationTrace:
    """Every tensor storage made while it observes a FakeRank, in order, the stream it was made on, and
    when it is freed: the trace the allocator model replays. Events: ("alloc", token, bytes, stream),
    ("free", token), and the markers `mark` adds.

    A storage is freed when its Python object dies, or when it is resized to 0 bytes: FSDP2 frees a
    gathered weight so (`free_storage`: `untyped_storage().resize_(0)`) and gathers the next into the
    same storage resized back up (`alloc_storage`), a new allocation. A storage's `resize_` is not an
    op: in eager it calls the device's resize directly (CUDA: `resize_bytes_cuda`, which allocates the
    new size, copies, frees the old), so no dispatch mode sees it (torch.compile traces it as
    `inductor.resize_storage_bytes_`); `resizes()` notes it while it lasts.

    Streams: the CUDA caching allocator keeps a block in the pool of the stream it was allocated on
    and hands it only to allocations on that stream. The stream is the device handle's current stream
    when the storage is made: on fake CPU tensors FSDP2's handle is torch.cpu, whose `stream(s)`
    context sets the `current_stream()` it returns, so its all-gather copy-in and reduce-scatter
    streams are told apart from the default stream as on CUDA (0: the default; 1, 2, ...: others, in
    the order first seen). FSDP2 orders reuse across streams by events, not `record_stream`, so a
    block freed from another stream goes straight back to its own stream's pool, as the replay does."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        # id(storage) -> [token (None while resized to 0 bytes), weak reference whose callback records
        # the free], while it lives: a storage's Python object is one for its life, and its id is
        # released only after the callback
        self._live: dict[int, list] = {}
        self._excluded: set[int] = set()
        self._streams: dict[int, tuple[int, object]] = {}  # id(stream) -> (its number, the stream)

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors made before the trace (parameters moved to the device), allocated in this order; a
        DTensor parameter (the dtensor engine's) by its local shard. (Its wrapper's storage, which
        holds no data, reports the whole tensor's bytes: the replay of a DTensor step held every
        parameter at its global size beside its shard, 108 to 135 MiB over the H200's allocator on
        the seed's preset at L 8, docs/results/gpu-check.md.)"""
        for t in tensors:
            self._note(t)

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors that live elsewhere on the emulated device (AdamW's step counters: on the host)."""
        for t in tensors:
            live = self._live.get(id(t.untyped_storage()))
            if live is not None and live[0] is not None:
                self._excluded.add(live[0])

    def mark(self, name: str) -> None:
        self.events.append((name,))

    def replayable(self) -> list[tuple]:
        return [e for e in self.events if len(e) == 1 or e[1] not in self._excluded]

    def observe(self, func: torch._ops.OpOverload, out: object) -> None:
        for t in tree_leaves(out) if not isinstance(out, torch.Tensor) else (out,):
            if isinstance(t, torch.Tensor):
                self._note(t)

    @contextlib.contextmanager
    def resizes(self) -> Iterator[None]:
        """While it lasts, every storage's `resize_` is noted: to 0 bytes a free, back up a new
        allocation (after the old is freed: as CUDA's resize allocates first, the old block's bytes
        are freed only once the new one is made)."""
        storage_class = torch.UntypedStorage
        own = "resize_" in vars(storage_class)
        original = storage_class.resize_

        def resize_(storage, size):
            before = storage.nbytes()
            out = original(storage, size)
            self._resized(storage, before)
            return out

        storage_class.resize_ = resize_
        try:
            yield
        finally:
            if own:
                storage_class.resize_ = original
            else:
                del storage_class.resize_

    def _stream(self) -> int:
        stream = torch.cpu.current_stream()
        if stream is torch.cpu._default_cpu_stream:
            return 0
        found = self._streams.get(id(stream))
        if found is None:
            found = self._streams[id(stream)] = (len(self._streams) + 1, stream)
        return found[0]

    def _alloc(self, size: int) -> int:
        token = len(self.events)
        self.events.append(("alloc", token, size, self._stream()))
        return token

    def _note(self, t: torch.Tensor) -> None:
        if _is_dtensor(t):  # its wrapper's storage has the global shape's bytes: none on a rank
            t = t.to_local()
        storage = t.untyped_storage()
        if id(storage) in self._live or storage.nbytes() == 0:
            return
        self._track(storage, self._alloc(storage.nbytes()))

    def _track(self, storage, token: int) -> None:
        key = id(storage)

        def freed(_: weakref.ref) -> None:
            if (held := self._live.pop(key)[0]) is not None:
                self.events.append(("free", held))

        self._live[key] = [token, weakref.ref(storage, freed)]

    def _resized(self, storage, before: int) -> None:
        after, entry = storage.nbytes(), self._live.get(id(storage))
        if entry is None:  # made empty before the trace saw it: its first bytes are an allocation
            if after:
                self._track(storage, self._alloc(after))
            return
        if after == before:
            return
        token, entry[0] = entry[0], self._alloc(after) if after else None
        if token is not None:
            self.events.append(("free", token))
