"""What every experiment builds the same way: the mesh, the models, the batches."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import os
from contextlib import AbstractContextManager
from dataclasses import asdict
from datetime import timedelta

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from tpbench.config import ModelConfig, RunConfig, lean_rmsnorm, local_batch
from tpbench.models.minimind import DTYPES, IGNORE_INDEX, MiniMindConfig, MiniMindForCausalLM, build_model
from tpbench.parallel import instrumentation
from tpbench.parallel.compiled import apply_compile
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.plan import ParallelModel, parallelize


def model_config(cfg: RunConfig) -> MiniMindConfig:
    """The dense model's config: ModelConfig's fields less its name and the Hugging Face config it
    was read from. A field the model does not know is refused unless it keeps its default."""
    fields = asdict(cfg.model)
    del fields["name"], fields["hf_config"]
    fields["lean_rmsnorm"] = lean_rmsnorm(cfg.model.lean_rmsnorm, cfg.train.recompute)  # auto: a bool
    known = {f.name for f in dataclasses.fields(MiniMindConfig)}
    for key in set(fields) - known:
        value = fields.pop(key)
        if value != getattr(ModelConfig, key):
            raise ValueError(f"model.{key}={value}: this dense model has no such switch yet")
    return MiniMindConfig(**fields)


def tensor_device(cfg: RunConfig) -> torch.device:
    """Where this rank's tensors live: its GPU under launch.device=cuda, else the CPU. A fake-tensor
    emulation of a GPU rank keeps them on the CPU (see tpbench.parallel.emulation for why)."""
    if cfg.launch.device == "cuda" and cfg.launch.emulate != "fake":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def context(cfg: RunConfig) -> ParallelContext:
    timeout = timedelta(seconds=cfg.launch.collective_timeout_s)
    return ParallelContext.of_world(cfg.parallel.tp, cfg.parallel.dp, tensor_device(cfg), timeout)


def place(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move every parameter of `module` to `device` and `dtype`, tied parameters staying tied.

    Module.to() cannot swap the storage of a fake parameter, so each parameter is replaced by a new
    one (tpbench's gradient sums find parameters by name). A fake tensor holds no values, and torch
    copies nothing across devices without a device guard: a fake parameter bound for another device
    is made there, empty."""
    moved: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) not in moved:
                moved[id(p)] = nn.Parameter(moved_to(p.detach(), device, dtype), p.requires_grad)
            mod._parameters[name] = moved[id(p)]
    return module


def moved_to(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (in `dtype`; None: its own). A fake tensor holds no values: on another device
    it is made there, empty (torch copies nothing across devices without a device guard)."""
    dtype = t.dtype if dtype is None else dtype
    if isinstance(t, FakeTensor) and t.device.type != device.type:
        return torch.empty(t.shape, dtype=dtype, device=device)
    return t.to(device=device, dtype=dtype)


def param_dtype(cfg: RunConfig) -> torch.dtype:
    """Pure precision keeps parameters in train.dtype; mixed keeps fp32 masters."""
    return DTYPES[cfg.train.dtype] if cfg.train.precision == "pure" else torch.float32


def precision(cfg: RunConfig, device: torch.device) -> AbstractContextManager:
    """What forward runs under: autocast(train.dtype) for mixed precision, nothing for pure."""
    if cfg.train.precision == "mixed":
        return torch.autocast(device.type, dtype=DTYPES[cfg.train.dtype])
    return contextlib.nullcontext()


def build_dense(cfg: RunConfig) -> MiniMindForCausalLM:
    return build_model(model_config(cfg), seed=cfg.train.seed)


def build_parallel(
    cfg: RunConfig, ctx: ParallelContext, dense: MiniMindForCausalLM | None = None
) -> ParallelModel:
    """The parallel model of `parallel.engine`, sharded from the dense model of the same seed (so it is
    the same model for every tp)."""
    model = copy.deepcopy(dense) if dense is not None else build_dense(cfg)
    low = cfg.debug.low_precision_reduce and cfg.train.precision == "mixed"
    if cfg.parallel.engine == "dtensor":
        from tpbench.parallel.dtensor import parallelize_dtensor

        pm = parallelize_dtensor(
            model, ctx, cfg.parallel, tuple(cfg.debug.skip_grad_sum), cfg.train.recompute
        )
        pm.dp_reduce_dtype = DTYPES[cfg.train.dtype] if low else None
        place(pm.module, ctx.device, param_dtype(cfg))
        if cfg.train.compile is True:  # an unresolved "auto" (a RunConfig built directly) runs eager
            apply_compile(pm.module, backend=cfg.train.compile_backend)
        return pm
    debug = cfg.debug
    skip = tuple(debug.skip_grad_sum)
    pm = parallelize(
        model, ctx, cfg.parallel, skip, cfg.train.recompute, debug.overlap_fault, debug.dropout_fault
    )
    pm.dp_reduce_dtype = DTYPES[cfg.train.dtype] if low else None  # the engine's own DP sum
    place(pm.module, ctx.device, param_dtype(cfg))
    if cfg.train.compile is True:
        apply_compile(pm.module, between_linears=cfg.parallel.overlap, backend=cfg.train.compile_backend)
    return pm


def counting(cfg: RunConfig, counter: instrumentation.CommCounter) -> AbstractContextManager:
    """Count the collectives of a training step: ours go through tpbench.parallel.collectives; DTensor's
    own are seen through a dispatch mode (dtensor._CommBytes), which no compiled graph runs under: that step
    runs eager under train.compile (its collectives are the compiled ones', which DTensor plans alike)."""
    if cfg.parallel.engine == "dtensor":
        from tpbench.parallel import dtensor

        if cfg.train.compile is not True:
            return dtensor.counting(counter)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(dtensor.counting(counter))
        return stack
    return instrumentation.counting(counter)


class Batches:
    """Seeded random token batches of the global batch; each DP rank takes its slice.
    A fixed pattern of ignored labels (every 7th position) exercises ignore_index with the same
    number of valid tokens in every sequence, so DP's average of local means is the global mean, and
    so is gradient accumulation's average over micro-batches.

    Under train.accumulation=K the global batch of a step is K micro-batches per DP rank: each rank's
    slice is K x its micro-batch, contiguous, which `micro` splits in order."""

    def __init__(self, cfg: RunConfig, ctx: ParallelContext, seed_offset: int = 1):
        self.vocab = cfg.model.vocab_size
        self.seq = cfg.train.seq_len
        self.local = local_batch(cfg)  # one micro-batch
        self.accumulation = cfg.train.accumulation
        self.dp, self.dp_rank = ctx.dp, ctx.dp_rank
        self.device = ctx.device
        self.gen = torch.Generator().manual_seed(cfg.train.seed + seed_offset)
        self._ready: collections.deque[tuple[torch.Tensor, torch.Tensor]] = collections.deque()

    def next_global(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ready:
            return self._ready.popleft()
        ids, labels = self._drawn()
        return moved_to(ids, self.device), moved_to(labels, self.device)  # fake tokens too

    def prefetch(self, count: int) -> None:
        """On a GPU: the next `count` global batches copied there now, from pinned memory without
        blocking the host, so that timed steps copy nothing from pageable memory (which waits for the
        copy). The same batches, in the same order, as drawn one by one; on a CPU nothing to do."""
        if self.device.type != "cuda":
            return
        for _ in range(count):
            pair = tuple(t.pin_memory().to(self.device, non_blocking=True) for t in self._drawn())
            self._ready.append(pair)  # type: ignore[arg-type]

    def _drawn(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.local * self.accumulation * self.dp
        ids = torch.randint(self.vocab, (rows, self.seq), generator=self.gen)
        labels = ids.clone()
        labels[:, 3::7] = IGNORE_INDEX
        return ids, labels

    def local_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This DP rank's rows of a global batch: its K micro-batches."""
        rows = self.local * self.accumulation
        return t[self.dp_rank * rows : (self.dp_rank + 1) * rows]

    def micro(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Micro-batch i of a rank's slice."""
        return t[i * self.local : (i + 1) * self.local]

    def next_local(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = self.next_global()
        return self.local_slice(ids), self.local_slice(labels)
