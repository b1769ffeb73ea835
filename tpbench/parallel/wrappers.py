"""The plan's wrappers, made explicit: region entry and exit modules, and the behaviours (recompute)
that a module takes on, composing in any order.

A region's entry (f: copy, g: all-gather) and its SP edges' exits (the embedding's scatter, the final
norm's gather) are modules of their own, children of the module they enter or leave, so that
`print(model)` shows where each collective sits:

    (self_attn): Attention(
      (entry): SPGather(all-gather over tp 2; backward reduce-scatter; saves the shard, re-gathers)
      (q_proj): ColumnParallelLinear(64 -> 32)
      ...
      (o_proj): RowParallelLinear(32 -> 64; exit reduce_scatter over tp 2)

A module takes on a behaviour by `wrap(module, Behaviour)`: its class becomes the (cached) subclass
with the behaviours it has, in one fixed order whatever the order of the calls (as FSDP2's
fully_shard swaps a module's class): recompute's checkpoint outside the region's entry and exit, the
entry and exit outside the module's own forward (or selective recompute's). The parameter names stay
the dense model's (a child without parameters adds none), so layouts, gradient sums and checkpoints
read as before. Each module calls the same autograd functions on the same tensors as the forward it
stands for: the bytes kept and moved are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tpbench.parallel import collectives, regions


def tp_size(group: collectives.Group) -> int:
    """The ranks of a TP group, for the modules' reprs (None: a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, a region's linears would each save their own cast of its input: cast it once,
    before the entry op, so that they share one tensor (SP's re-gather keeps the cast shard) and the
    entry's collectives move the autocast dtype."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def prefetch_after_backward(y: torch.Tensor, regathers: list[regions.Regather]) -> None:
    """Start the re-gathers once y's grad_fn has run: a block region's exit backward (g-bar's
    all-gather of the output gradient), before the row layer's and the core's backward. The hook
    lets them go once it has run: the graph's nodes (and their hooks) live as long as the loss the
    step returns, and each re-gather holds its gathered input, which would then outlive backward
    (6,144 B at T 2, S 4, the test model's four regions, to the optimizer step)."""

    def prefetch(*_) -> None:
        for regathered in regathers:
            regathered.prefetch()
        regathers.clear()  # the saved tensors' packs hold them for backward's uses

    if y.grad_fn is not None:
        y.grad_fn.register_hook(prefetch)


class Boundary(nn.Module):
    """An entry or exit module: where a region's collective sits (no parameters)."""


# --- entries: forward(x, body) runs body (the region) on the entered input ---------------------


class TPCopy(Boundary):
    """f: the identity forward, all-reduce of the input gradient in backward (with `meanwhile`, the
    region's deferred weight gradients run while it is in flight: parallel.overlap)."""

    def __init__(self, group: collectives.Group, meanwhile=None):
        super().__init__()
        self.group, self.meanwhile = group, meanwhile

    def extra_repr(self) -> str:
        overlap = "; overlapped with the weight gradients" if self.meanwhile is not None else ""
        return f"copy over tp {tp_size(self.group)}; backward all-reduce{overlap}"

    def forward(self, x: torch.Tensor, body: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return body(regions.copy_to_tp_region(autocast_input(x), self.group, self.meanwhile))


class SPGather(Boundary):
    """g: all-gather of the sequence shard [S/T, B, H] -> [S, B, H], reduce-scatter in backward.
    `regather`: the region's layers save the shard only and gather it again in backward; with
    overlap, the re-gather is handed to `regathers` (a column linear of a per-linear region) or
    started at the region's exit backward (`prefetch`); `site` keeps a per-linear all-gather apart
    from its siblings' under torch.compile."""

    def __init__(
        self,
        group: collectives.Group,
        regather: bool,
        meanwhile=None,
        regathers: list[regions.Regather] | None = None,
        prefetch: bool = False,
        site: str = "",
    ):
        super().__init__()
        self.group, self.regather, self.meanwhile = group, regather, meanwhile
        self.regathers, self.prefetch, self.site = regathers, prefetch, site

    def extra_repr(self) -> str:
        notes = ["saves the shard, re-gathers"] if self.regather else []
        if self.meanwhile is not None:
            notes.append("overlapped with the weight gradients")
        return "; ".join([f"all-gather over tp {tp_size(self.group)}", "backward reduce-scatter", *notes])

    def forward(self, x: torch.Tensor, body: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = autocast_input(x)
        full = regions.gather_from_sp_region(x, self.group, self.meanwhile, self.site)  # [S/T,B,H] -> [S,B,H]
        if not self.regather:
            return body(full)
        with regions.saving_only_shard(full, x, self.group) as regathered:
            y = body(full)
        if self.meanwhile is None:
            return y
        if self.regathers is not None:
            self.regathers.append(regathered)
        elif self.prefetch:  # the LM head has no exit: its first backward op needs the input
            prefetch_after_backward(y, [regathered])
        return y


class PerLinearGathers(Boundary):
    """parallel.sp_gather=linear: the region casts its input once (its column linears, each with its
    own SPGather, gather the same shard); with overlap and the re-gather, it starts all their
    re-gathers at its exit backward."""

    def __init__(self, regathers: list[regions.Regather]):
        super().__init__()
        self.regathers = regathers

    def extra_repr(self) -> str:
        return "one cast input; each column linear gathers its own"

    def forward(self, x: torch.Tensor, body: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        self.regathers.clear()
        y = body(autocast_input(x))
        if self.regathers:
            prefetch_after_backward(y, list(self.regathers))
        self.regathers.clear()  # held by the hook (and backward's packs) only, not to the next step
        return y


# --- exits: forward(y) -------------------------------------------------------------------------


class SPScatter(Boundary):
    """The embedding's exit under SP with a replicated vocab: keep this rank's sequence shard
    [S, B, H] -> [S/T, B, H]; backward all-gathers."""

    def __init__(self, group: collectives.Group):
        super().__init__()
        self.group = group

    def extra_repr(self) -> str:
        return f"split over tp {tp_size(self.group)}; backward all-gather"

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return regions.scatter_to_sp_region(y, self.group)


class SPGatherReplicated(Boundary):
    """The final norm's exit under SP with a replicated vocab: all-gather the shard for the full LM
    head, [S/T, B, H] -> [S, B, H]; backward keeps this rank's part (the head is replicated)."""

    def __init__(self, group: collectives.Group):
        super().__init__()
        self.group = group

    def extra_repr(self) -> str:
        return f"all-gather over tp {tp_size(self.group)}; backward split"

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return regions.gather_from_sp_region_replicated(y, self.group)


# --- behaviours --------------------------------------------------------------------------------


class Region:
    """Runs the module's forward through its `entry` child (if any) and its output through its `exit`
    child (if any)."""

    def forward(self, x: torch.Tensor, *args, **kwargs):
        inner = super().forward
        entry, exit_ = self._modules.get("entry"), self._modules.get("exit")
        y = inner(x, *args, **kwargs) if entry is None else entry(x, lambda v: inner(v, *args, **kwargs))
        return y if exit_ is None else exit_(y)


_BEHAVIOURS: list[type] = []  # outermost first
_CLASSES: dict[tuple[type, tuple[type, ...]], type] = {}


def behaviour(cls: type, before: type | None = None) -> type:
    """Register a behaviour class, outside `before` (None: innermost)."""
    _BEHAVIOURS.insert(_BEHAVIOURS.index(before) if before else len(_BEHAVIOURS), cls)
    return cls


behaviour(Region)


def wrap(module: nn.Module, cls: type) -> nn.Module:
    """Give `module` the behaviour `cls`: its class becomes the subclass of its plain class with all
    its behaviours, outermost first in the order registered, whatever the order of the calls. One
    class per combination, shared by all modules that have it (torch.compile guards on it)."""
    plain = getattr(type(module), "plain_class", type(module))
    have = set(getattr(type(module), "behaviours", ())) | {cls}
    ordered = tuple(b for b in _BEHAVIOURS if b in have)
    key = (plain, ordered)
    if key not in _CLASSES:
        attrs = {"plain_class": plain, "behaviours": ordered, "__module__": plain.__module__}
        _CLASSES[key] = type(plain.__name__, (*ordered, plain), attrs)
    module.__class__ = _CLASSES[key]
    return module


def set_entry(module: nn.Module, entry: nn.Module) -> None:
    """`entry` runs before `module`'s forward; it prints first among its children."""
    module._modules = {"entry": entry, **module._modules}
    wrap(module, Region)


def set_exit(module: nn.Module, exit_: nn.Module) -> None:
    """`exit_` runs on `module`'s output; it prints last among its children."""
    module.add_module("exit", exit_)
    wrap(module, Region)
