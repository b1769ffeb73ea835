"""Per-rank peak memory of a training step, after warm-up, beside the analytic prediction.

CPU and GPU alike: `peak_bytes` is the peak of live tensors by torch's MemTracker, which attributes
every one to parameters, buffers, gradients, activations, temporaries or optimizer state.
A GPU also reports its caching allocator's peaks (max_memory_allocated / max_memory_reserved after
reset_peak_memory_stats); an emulated GPU rank (tpbench.parallel.emulation) reports what the allocator model
(tpbench.predict.allocator) makes of its allocation trace instead.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from tpbench.config import RunConfig
from tpbench.experiments import steady_after
from tpbench.experiments.progress import StepProgress
from tpbench.experiments.setup import context, counting
from tpbench.experiments.training import Trainer
from tpbench.parallel import collectives, emulation, instrumentation
from tpbench.predict import allocator, theory
from tpbench.predict.theory import reserved
from tpbench.results import RankResult

# MemTracker's categories -> tpbench's measurement names
CATEGORIES = {
    "Parameter": "mem_params_bytes",
    "Gradient": "mem_grads_bytes",
    "Optstate": "mem_optimizer_bytes",
    "Activation": "mem_activations_bytes",
    "Temp": "mem_temporaries_bytes",
    "Buffer": "mem_buffers_bytes",
    "Other": "mem_other_bytes",
}


# the live storages at the last measured peak of this process (PeakTracker.peak_storages), when
# TPBENCH_PEAK_STORAGES is set: the tests' jobs report it beside each rank's peak
last_peak_storages: dict[str, int] = {}

# functional ops that issue no collective
_NOT_ISSUING = {
    torch.ops._c10d_functional.wait_tensor.default,
    torch.ops._c10d_functional._wrap_tensor_autograd.default,
}


class PeakTracker(MemTracker):
    """MemTracker keeping the device's peak and its split by category, not each module's: its
    per-module peaks cost time quadratic in depth (135 s a step at L 32), and tpbench reads none.
    Its module hooks stay MemTracker's own: hooks that skipped its per-module snapshots measured
    2.5-12.5 KB more on some ranks (tp 4, SP + VP) than MemTracker does."""

    def __init__(self) -> None:
        super().__init__()
        self._settle = dist.is_initialized() and dist.get_backend() == "gloo"
        self.peak_at = ""  # where the peak fell: its phase of the step and innermost module (_where)
        self._after_backward = False  # this step's backward has run
        self._snap_lock = threading.Lock()
        self._thread = threading.get_ident()
        self.late_frees = 0  # storages a backend's thread freed outside a collective's wait (below)
        # with TPBENCH_PEAK_STORAGES set (the tests' jobs): the live storages at the peak, by size and
        # category, so that a rank whose peak differs says which storage it held (`peak_storages`)
        self.keep_storages = bool(os.environ.get("TPBENCH_PEAK_STORAGES"))
        self.peak_storages: dict[str, int] = {}

    def _update_snap(self, *args, **kwargs) -> None:
        """As MemTracker's, one update at a time: a storage that gloo's worker thread lets go of last is
        freed on that thread, whose weakref callback updates the counts too, and a read-modify-write
        of the totals interleaved with the main thread's would lose one. A guard: no lost update was
        seen (4,000 frees on a second thread against the main thread's, switched every microsecond)."""
        with self._snap_lock:
            super()._update_snap(*args, **kwargs)

    def _delete_callback(self, winfo, w_st) -> None:
        """As MemTracker's; counts a storage freed by another thread (gloo's worker, letting go last)
        while this one was not waiting on a collective: freed at a moment that thread chose, so the
        step's peak may hold it or not. Inside instrumentation.settling the worker runs on staging
        copies no tracker sees (collectives._launch), or is waited for (DDP's buckets): the count is
        0 (`memory_late_frees`)."""
        if threading.get_ident() != self._thread and not instrumentation.is_waiting():
            self.late_frees += 1
        super()._delete_callback(winfo, w_st)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """As MemTracker; over gloo, a functional collective (the dtensor engine's) runs on staging
        copies of its inputs that no tracker sees, is waited on as it is issued, and returns a tracked
        copy of its output, made at once: gloo's worker never holds a tensor the tracker counts, as
        tpbench's own collectives run staged inside instrumentation.settling (collectives._launch).
        Issued on the caller's input, that input, often dropped by the caller right after (the final
        norm's output shard, gathered for the LM head), was freed whenever the worker let go: 4 KB
        more on one rank in 2-3 of 30 steps (tp 4, SP); its later wait finds it done. An in-place one
        (none of the dtensor engine's) waits for the worker to let go of its inputs instead."""
        if not self._settle or func.namespace != "_c10d_functional" or func in _NOT_ISSUING:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func._schema.is_mutable:
            inputs = tuple(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            before = instrumentation.references(inputs)
            with instrumentation.waiting():
                out = super().__torch_dispatch__(func, types, args, kwargs)
                _wait_all(out)
                instrumentation.settle_released(inputs, before)
            return out
        with collectives.untracked():
            staged_args, staged_kwargs = tree_map_only(torch.Tensor, torch.clone, (args, kwargs or {}))
            raw = func(*staged_args, **staged_kwargs)
            _wait_all(raw)
        track = super().__torch_dispatch__  # the output as the collective would have made it
        return tree_map_only(
            torch.Tensor, lambda t: track(torch.ops.aten.clone.default, types, (t,), {}), raw
        )

    def _update_peak_stats(self, peak_state) -> None:
        backward = peak_state == _ModState.PEAK_BW
        self._after_backward |= backward
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)
                self.peak_at = self._where(backward)
                if self.keep_storages:
                    self.peak_storages = self.live_storages()

    def live_storages(self) -> dict[str, int]:
        """The tracked live storages now: "<bytes> <category>" -> how many."""
        live = collections.Counter(
            f"{winfo.mem_consumed} {winfo.reftype.value}"
            for winfo, _ in list(self._WINFO.values())
            if winfo.mem_consumed > 0
        )
        return dict(sorted(live.items()))

    def _where(self, backward: bool) -> str:
        """The moment of the step now: its phase (forward, backward, after backward: the gradient sums,
        optimizer) and the innermost modules running, by name ("Global": none). In backward several
        can run at once: SDPA's backward makes the gradients of q, k and v together, and v_proj's
        backward begins while q_norm's and k_norm's run."""
        if self._in_opt:
            phase = "optimizer"
        elif backward:
            phase = "backward"
        else:
            phase = "after backward" if self._after_backward else "forward"
        running = self._mod_tracker.parents - {"Global"}
        innermost = sorted(m for m in running if not any(o.startswith(f"{m}.") for o in running))
        return f"{phase} {' '.join(innermost) or 'Global'}"

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: object) -> None:
        """As MemTracker's; the root's forward again within a step (train.accumulation's next
        micro-batch) starts its module statistics afresh, as a step does (tpbench reads none of them;
        MemTracker would refuse the second call), and its phase is a forward again."""
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            if set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def reset_mod_stats(self) -> None:
        """After each step: the next one starts with its forward."""
        super().reset_mod_stats()
        self._after_backward = False


def _wait_all(out: object) -> None:
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(t)


class _Unpushed(TorchDispatchMode):
    """A dispatch mode never pushed on the stack: what MemTracker sets up on entry (its module,
    gradient and optimizer hooks), without it seeing each op itself."""

    def __enter__(self) -> _Unpushed:
        return self

    def __exit__(self, *args) -> None:
        return None


class ObservingPeakTracker(PeakTracker, _Unpushed):
    """PeakTracker fed by a FakeRank (tpbench.parallel.emulation) rather than a dispatch mode above it:
    `observe` does, after each op, what MemTracker.__torch_dispatch__ does after running it. (Its one special
    case, DTensor's wait_tensor under fake tensors, is for functional collectives, which only the
    dtensor engine issues: that engine keeps PeakTracker as a mode.)"""

    def observe(self, func: torch._ops.OpOverload, out: object) -> None:
        backward = self._mod_tracker.is_bw
        if self._in_opt:
            reftype = _MemRefType.OPT
        elif backward and not self._in_ac:
            reftype = _MemRefType.TEMP
        else:
            reftype = _MemRefType.ACT
        for t in tree_leaves(out) if not isinstance(out, torch.Tensor) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(reftype, t)
        self._update_peak_stats(_ModState.PEAK_BW if backward else _ModState.PEAK_FW)


def run(cfg: RunConfig) -> RankResult:
    ctx = context(cfg)  # the mesh reads the store: made before any fake tensor
    trace = emulation.AllocationTrace() if emulation.gpu_emulated(cfg) else None
    with contextlib.ExitStack() as stack:
        mode = stack.enter_context(emulation.tensor_mode(cfg))

        def on_device(module: torch.nn.Module) -> None:  # as if just moved to the GPU, in order
            if trace is not None:
                trace.adopt(module.parameters())
                stack.enter_context(mode.observed_by(trace.observe))
                stack.enter_context(trace.resizes())  # FSDP2's frees of gathered weights

        trainer = Trainer(cfg, ctx, on_device)
        if trace is not None:
            trace.mark("gemm_workspaces")  # the first GEMMs (forward, backward) allocate them
        return _measure(cfg, trainer, trace, mode)


def measure_in_process(cfg: RunConfig) -> RankResult:
    """The memory experiment of the emulated rank (tpbench.parallel.emulation), in this process (no launcher):
    for `tpbench plan --measure`, `tpbench fit --measure` and the tests. The process group lives only
    for the call."""
    emulation.init_process_group(cfg)
    try:
        return run(cfg)
    finally:
        dist.destroy_process_group()


def measure_busiest(cfg: RunConfig) -> tuple[dict[str, float], float]:
    """The memory experiment of the config's busiest rank on fake tensors, in this process: its
    measurements by name, and the seconds it took."""
    # the peak of a step repeats from the second step on: one warm-up step, one measured
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, warmup=1, steps=1))
    gc.freeze()  # the imports' objects, out of the way of run's gc.collect (0.3 s -> ms)
    start = time.perf_counter()
    result = {m.name: m.value for m in measure_in_process(cfg).measurements}
    return result, time.perf_counter() - start


def _tracker(cfg: RunConfig, mode) -> tuple[PeakTracker, contextlib.AbstractContextManager]:
    """The memory tracker of the measured steps, and what feeds it ops."""
    if isinstance(mode, emulation.FakeRank) and cfg.parallel.engine != "dtensor":
        tracker = ObservingPeakTracker()
        return tracker, mode.observed_by(tracker.observe)
    return PeakTracker(), contextlib.nullcontext()


def _tracked_steps(cfg: RunConfig, trainer: Trainer, mode, progress: StepProgress | None):
    """The measured steps under a fresh tracker: the tracker, and the first step's collectives."""
    tracker, feed = _tracker(cfg, mode)
    tracker.track_external(trainer.module, *trainer.tracked())
    # Python's cycle collector, run at a moment of its choosing inside the step, made MemTracker's
    # peak 31 KB higher on a random rank (tp 4, SP + VP, fp32): the steps start with no garbage and
    # run without it, so every rank measures the same step (a cycle left alive could only add)
    gc.collect()
    gc.disable()
    # the first measured step's collectives: counting allocates nothing
    counter = instrumentation.CommCounter()
    try:
        with tracker, feed, instrumentation.settling():
            for step in range(cfg.train.steps):
                with counting(cfg, counter) if step == 0 else contextlib.nullcontext():
                    trainer.step()
                tracker.reset_mod_stats()  # per-module stats are per iteration; the peak is kept
                if progress is not None:
                    progress.step()
    finally:
        gc.enable()
    return tracker, counter


def _measure(cfg: RunConfig, trainer: Trainer, trace: emulation.AllocationTrace | None, mode) -> RankResult:
    result = RankResult(rank=trainer.ctx.rank)
    warmup = max(cfg.train.warmup, steady_after(cfg))
    progress = StepProgress("memory", warmup + cfg.train.steps)
    for _ in range(warmup):
        trainer.step()
        progress.step()

    on_gpu = trainer.ctx.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    host_counters = _host_step_counters(trainer) if trace is not None else []
    if trace is not None:
        trace.exclude(host_counters)
        trace.mark("window")
    tracker, counter = _tracked_steps(cfg, trainer, mode, progress)
    # storages a backend's thread freed outside a collective's wait: none, settling waits for its thread
    result.add("memory_late_frees", tracker.late_frees, "")
    result.comm = counter.rows()
    result.add("comm_bytes_per_step", sum(r.bytes for r in result.comm), "B")
    peak = tracker.get_tracker_snapshot("peak")[trainer.ctx.device]
    # an emulated GPU keeps AdamW's step counters on the host, where the CPU stand-in cannot
    counters = sum(t.untyped_storage().nbytes() for t in host_counters)
    peak["Optstate"], peak["Total"] = peak.get("Optstate", 0) - counters, peak["Total"] - counters
    for category, name in CATEGORIES.items():
        result.add(name, peak.get(category, 0), "B")
    result.add("peak_bytes", peak["Total"], "B")
    if cfg.train.grad_clip:  # train.grad_clip_nonfinite=skip: the optimizer steps a non-finite norm skipped
        result.add("grad_clip_skipped_steps", float(trainer.skipped_steps))
    result.peak_at = tracker.peak_at
    global last_peak_storages
    last_peak_storages = tracker.peak_storages
    if on_gpu:
        result.add("max_memory_allocated_bytes", torch.cuda.max_memory_allocated(), "B")
        result.add("max_memory_reserved_bytes", torch.cuda.max_memory_reserved(), "B")
    if trace is not None:
        events = trace.replayable()
        peaks = allocator.replay(events, cfg.launch.emulate_gpu)
        result.add("modelled_max_memory_allocated_bytes", peaks.allocated, "B")
        result.add("modelled_max_memory_reserved_bytes", peaks.reserved, "B")
        # the same step under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's launch)
        expandable = allocator.replay(events, cfg.launch.emulate_gpu, expandable=True)
        result.add("modelled_max_memory_reserved_expandable_bytes", expandable.reserved, "B")

    predicted = theory.predict(cfg)
    result.add("predicted_peak_bytes", predicted.peak_bytes, "B")
    for name, value in predicted.breakdown().items():
        result.add(f"predicted_{name}", value, "B")
    result.add("predicted_comm_bytes_per_step", predicted.comm_bytes_per_step, "B")
    gpu = cfg.launch.emulate_gpu if trace is not None else allocator.gpu_of(_device_name(trainer))
    if gpu is not None:  # an emulated GPU, or a real one the allocator model knows
        result.add("predicted_max_memory_allocated_bytes", predicted.max_memory_allocated_bytes(gpu), "B")
        reserve = reserved.reserved(cfg, predicted, gpu).total
        result.add("predicted_max_memory_reserved_bytes", reserve, "B")
    return result


def _device_name(trainer: Trainer) -> str:
    return torch.cuda.get_device_name(trainer.ctx.device) if trainer.ctx.device.type == "cuda" else ""


def _host_step_counters(trainer: Trainer) -> list[torch.Tensor]:
    """AdamW's `step` counters: on a GPU they stay on the host (torch keeps them there unless the
    optimizer is capturable or fused: then on the parameters' device, which a GPU counts)."""
    adamw = getattr(trainer.optimizer, "adamw", trainer.optimizer)  # ZeRO-1's: its master shard's
    if any(getattr(adamw, "defaults", {}).get(k) for k in ("fused", "capturable")):
        return []
    return [state["step"] for state in trainer.optimizer.state.values() if "step" in state]
