"""Trace one training step on every TP rank, each emulated in this process on fake tensors.

Rank r of T runs as rank r of torch's fake process group, its tensors fake (tpbench.parallel.emulation's
FakeRank, a FakeTensorMode): they carry shapes, dtypes and storages but no values, and no op
computes, so a step at any shape takes about as long as at a tiny one (a Qwen3-0.6B block at T 4:
seconds, where a real CPU step took minutes), while every shape, shard and collective is the one a
real job has. The real `Trainer` builds the sharded model and takes one step, while
  - module forward hooks record each module call: its inputs, its output, this rank's parameters;
  - a TorchFunctionMode records the functional ops between modules (attention, SwiGLU, residual adds);
  - module backward hooks say whose backward is running when a backward collective is issued;
  - instrumentation.CommCounter(log=True) records every collective in the order it was issued.
Who feeds whom comes from the tensors themselves: a call's input is the output of the call that made
its storage. Where shards sit in the dense weights comes from the plan's layouts (`Layout.span`).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from tpbench.config import RunConfig
from tpbench.experiments.setup import build_dense, context
from tpbench.experiments.training import Trainer
from tpbench.models.minimind import FeedForward, MiniMindBlock
from tpbench.parallel import instrumentation
from tpbench.parallel.emulation import FakeRank
from tpbench.parallel.plan import Layout
from tpbench.parallel.wrappers import Boundary


@dataclass
class Shard:
    """This rank's part of one dense parameter."""

    name: str  # the dense name, e.g. model.layers.0.self_attn.q_proj.weight
    semantics: str  # the plan's Layout: column, row, replicated, replicated_sum, kv_replicated, vocab
    dense_shape: tuple[int, ...]
    shape: tuple[int, ...]  # this rank's tensor (nn.Linear view: [out, in])
    dim: int | None  # the dim of the dense weight it is cut from; None: the whole of it
    start: int = 0  # the dense indices along `dim` this rank holds (the plan's Layout.span)
    stop: int = 0
    grad_sum: str | None = None  # the gradient sum this parameter needs, if any


@dataclass
class Call:
    """A module call or a functional op of the forward, in execution order."""

    id: int
    name: str  # module path, or the enclosing module's path + "." + the op
    kind: str  # the module's class, or the op
    parent: str  # the enclosing module's path ("" for the model itself)
    inputs: list[tuple[int, ...]]  # floating-point tensor inputs
    output: tuple[int, ...]
    sources: list[int]  # ids of the calls whose outputs it reads
    shards: list[Shard] = field(default_factory=list)  # the module's own parameters


@dataclass
class Collective:
    index: int  # issue order on this rank
    event: instrumentation.CommEvent
    phase: str  # forward | backward | gradient sums
    module: str  # the module whose forward or backward issued it ("" for the gradient sums)
    node: str = ""  # backward: the autograd node that issued it, e.g. _GatherFromSPBackward
    summed: tuple[str, ...] = ()  # gradient sums: the dense parameter names summed
    sum_name: str = ""  # gradient sums: qk_norm, sp_norms, kv_replicas (joined by + when coalesced)


@dataclass
class RankTrace:
    rank: int
    calls: list[Call]
    collectives: list[Collective]


@dataclass
class Trace:
    cfg: RunConfig  # as traced: one layer, dp = 1
    ranks: list[RankTrace]


PHASES = ("forward", "backward", "gradient sums")


def trace(cfg: RunConfig) -> Trace:
    """One training step of `cfg` on each of its tp ranks. The caller has checked the config."""
    if dist.is_initialized():
        raise RuntimeError("tracing needs a process without a default process group")
    cfg = copy.deepcopy(cfg)
    cfg.launch.device, cfg.launch.backend = "cpu", "gloo"
    tp = cfg.parallel.tp
    ranks = []
    with warnings.catch_warnings():
        # the embedding's full backward hook fires at its output (token ids need no gradient): as wanted
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        for rank in range(tp):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
            try:
                ranks.append(_trace_rank(cfg, rank))
            finally:
                dist.destroy_process_group()
    return Trace(cfg, ranks)


def _trace_rank(cfg: RunConfig, rank: int) -> RankTrace:
    ctx = context(cfg)  # the groups read the store: made before any fake tensor
    with FakeRank():
        trainer = Trainer(cfg, ctx)
        pm = trainer.model
        dense = {n: tuple(p.shape) for n, p in build_dense(cfg).named_parameters(remove_duplicate=False)}
        recorder = _Recorder(trainer.module)
        recorder.shards = {
            name: _locate(name, p, dense[name], pm.layouts[name], ctx.tp, ctx.tp_rank)
            for name, p in trainer.module.named_parameters(remove_duplicate=False)
        }
        log = _Log(recorder)
        with recorder.hooked(), instrumentation.counting(log):
            trainer.step()
    # finish_grads issues one coalesced all-reduce per GradSum that has gradients, in order
    params = dict(trainer.module.named_parameters())
    sums = iter([gs for gs in pm.grad_sums if any(params[n].grad is not None for n in gs.params)])
    collectives = []
    for i, (event, (phase, module, node)) in enumerate(zip(log.events or [], log.context, strict=True)):
        c = Collective(i, event, phase, module, node)
        if event.purpose in ("grad_sum", "dp_grads"):
            gs = next(sums)
            c.phase, c.module, c.node = "gradient sums", "", ""
            c.sum_name, c.summed = gs.name, tuple(gs.params)
        collectives.append(c)
    return RankTrace(rank, recorder.calls, collectives)


class _Log(instrumentation.CommCounter):
    """The ordered log of collectives, each with where the step was when it was issued."""

    def __init__(self, recorder: _Recorder):
        super().__init__(log=True)
        self.recorder = recorder
        self.context: list[tuple[str, str, str]] = []

    def record(self, *args, **kwargs) -> None:
        super().record(*args, **kwargs)
        self.context.append(self.recorder.where())


def _locate(
    name: str, param: torch.Tensor, dense: tuple[int, ...], layout: Layout, tp: int, tp_rank: int
) -> Shard:
    """This rank's shard of the dense weight: the indices along the cut dim, by the plan's layout (a
    padded vocab's last shard ends in padded rows that are in no dense row)."""
    shard = Shard(name, layout.semantics, dense, tuple(param.shape), layout.dim, grad_sum=layout.grad_sum)
    if layout.dim is None:
        shard.stop = dense[0]
        return shard
    shard.start, shard.stop = layout.span(dense[layout.dim], tp, tp_rank)
    return shard


# The functional ops between modules worth a box of their own: (op, the enclosing module's class).
_OPS = {
    F.scaled_dot_product_attention: ("attention", None),
    F.softmax: ("softmax", None),
    F.silu: ("silu", FeedForward),
    torch.Tensor.mul: ("multiply", FeedForward),
    torch.Tensor.add: ("residual add", MiniMindBlock),
}


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.paths = {m: n for n, m in model.named_modules()}
        self.shards: dict[str, Shard] = {}
        self.calls: list[Call] = []
        self.stack: list[nn.Module] = []  # the forward's open module calls
        self.producer: dict[int, int] = {}  # storage pointer -> id of the call whose output it is
        self.unconsumed: list[int] = []  # calls whose output no later call has read yet
        self.keep: list[torch.Tensor] = []  # what was seen stays alive: one storage pointer, one tensor
        self.phase = "forward"
        self.open: list[str] = []  # modules whose backward is running, innermost last
        self.last_backward = ""  # the module whose backward began last

    def where(self) -> tuple[str, str, str]:
        """(phase, module, autograd node) now: the innermost module whose forward or backward runs."""
        if self.phase == "forward":
            module = self.paths[self.stack[-1]] if self.stack else ""
            return "forward", module, ""
        node = torch._C._current_autograd_node()
        return "backward", self.open[-1] if self.open else self.last_backward, node.name() if node else ""

    # -- hooks --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        handles = []
        for module in self.model.modules():
            if isinstance(module, Boundary):  # a region's entry or exit: its ops belong to the region
                continue
            handles += [
                module.register_forward_pre_hook(self._pre, with_kwargs=True),
                module.register_forward_hook(self._post, with_kwargs=True),
            ]
            if module is not self.model:
                handles += [
                    module.register_full_backward_pre_hook(self._backward_pre),
                    module.register_full_backward_hook(self._backward_post),
                ]
        try:
            with self:
                yield
        finally:
            for h in handles:
                h.remove()
            self.keep.clear()

    def _pre(self, module, args, kwargs):
        self.stack.append(module)

    def _post(self, module, args, kwargs, output):
        self.stack.pop()
        if module is self.model:
            self.phase = "backward"
        elif not any(not isinstance(c, Boundary) for c in module.children()):
            path = self.paths[module]
            shards = [self.shards[f"{path}.{n}"] for n, _ in module.named_parameters(recurse=False)]
            self._record(path, type(module).__name__, [*args, *kwargs.values()], output, shards)

    def _backward_pre(self, module, grad_output):
        self.open.append(self.paths[module])
        self.last_backward = self.paths[module]

    def _backward_post(self, module, grad_input, grad_output):
        self.open.remove(self.paths[module])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = _OPS.get(func)
        if op is not None and self.stack and self.stack[-1] is not self.model:
            parent = self.stack[-1]
            if op[1] is None or isinstance(parent, op[1]):
                path = self.paths[parent]
                self._record(f"{path}.{op[0]}", op[0], [*args, *kwargs.values()], out, [], parent=path)
        return out

    def _record(
        self, name: str, kind: str, inputs: list, output, shards: list[Shard], parent: str | None = None
    ) -> None:
        tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if isinstance(output, tuple):
            output = output[0]
        call_id = len(self.calls)
        if parent is None:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
        sources: list[int] = []
        for t in tensors:
            ptr = t.untyped_storage()._cdata  # the storage's identity, fake tensors' too
            if ptr in self.producer:
                found = [self.producer[ptr]]
            else:  # made by ops that are no call (RoPE, a collective): read what is still unread
                inside = [c for c in self.unconsumed if self.calls[c].parent.startswith(parent)]
                found = inside or self.unconsumed[-1:]
                self.producer[ptr] = found[0] if len(found) == 1 else -1
            sources += [s for s in found if s >= 0 and s not in sources]
        for s in sources:
            if s in self.unconsumed:
                self.unconsumed.remove(s)
        self.calls.append(
            Call(
                call_id,
                name,
                kind,
                parent,
                [tuple(t.shape) for t in tensors],
                tuple(output.shape),
                sources,
                shards,
            )
        )
        self.unconsumed.append(call_id)
        self.producer[output.untyped_storage()._cdata] = call_id
        self.keep += [*tensors, output]
