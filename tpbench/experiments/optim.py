"""The run's AdamW: its weight-decay groups and its learning-rate schedule, the same for every engine.

Weight decay groups (train.no_decay, a list of what is left undecayed; train.weight_decay is the
decayed group's): norms (every RMSNorm's weight: the layer norms, the q/k norms, the final norm),
biases (q, k, v under model.attention_bias) and embeddings (the input embedding, and with it a tied
LM head). Megatron's default is [norms, biases] (megatron/core/optimizer/__init__.py,
`_get_param_groups`: no decay where `name.endswith(".bias") or len(param.shape) == 1`); excluding the
embedding is its option (NeMo's `no_weight_decay_cond` with exclude_embeddings, matched on
"embedding" in the name), which leaves Megatron's untied output layer decayed: here too an untied
`lm_head.weight` is a projection like any other and decays. torchtitan decays every parameter
(`build_optimizers` over model.parameters()): train.no_decay=[], the default, which keeps every run
as it was. Parameters are told apart by name, so every engine, DP level and DTensor agrees
(FSDP2 and ZeRO-1 keep the module's names).

The schedule (train.lr_scheduler) is torchtitan's `linear_warmup_stable_decay`
(torchtitan/components/lr_scheduler.py at 0e13811): a LambdaLR factor of train.lr, stepped after every
optimizer step, so step i (0-based) runs at lr x factor(i):

    warm-up  i < W:              (i + 1) / (W + 1)
    stable   i < W + S:          1
    decay    i < W + S + D:      progress = (i + 1 - W - S) / (D + 1); linear 1 - progress,
                                 sqrt 1 - sqrt(progress), cosine (1 + cos(pi progress)) / 2,
                                 then min_lr_factor + (1 - min_lr_factor) x that
    past the horizon:            as at i = W + S + D

with D = round(horizon x decay_ratio) (decay_ratio None: every step after the warm-up, torchtitan's
default; cut to horizon - W where W + D would pass the horizon, as torchtitan's 73bb964 warned and cut)
and S = horizon - W - D. The horizon: the steps a run takes (memory and throughput: train.warmup +
train.steps; validation: validate.steps). The defaults (warmup_steps 0, decay_ratio 0) are a factor
of 1 at every step: no scheduler is built, the lr stays constant, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from tpbench.config import RunConfig, TrainConfig
from tpbench.models.param_kinds import EMBEDDING, kind_of

__all__ = ["EMBEDDING", "adamw", "decays", "kind_of", "param_groups", "scheduler"]

FAULT_PARAM = "model.norm.weight"  # debug.optim_fault=decay_norm: the norm the sharded side decays


def decays(name: str, train: TrainConfig, fault: str = "") -> bool:
    """Whether AdamW decays parameter `name` (at train.weight_decay). fault: debug.optim_fault, given
    on the side under test only (decay_norm: FAULT_PARAM decays there)."""
    if fault == "decay_norm" and name == FAULT_PARAM:
        return True
    return kind_of(name) not in train.no_decay


def decay_rule(cfg: RunConfig) -> Callable[[str], bool] | None:
    """Which parameters of the sharded side decay (`decays`, debug.optim_fault included), for ZeRO-1's
    pieces (their decayed spans); None where the groups change nothing: every parameter decays, or none
    does."""
    fault = cfg.debug.optim_fault
    if not cfg.train.weight_decay or not (cfg.train.no_decay or fault == "decay_norm"):
        return None
    return lambda name: decays(name, cfg.train, fault)


def param_groups(
    named: Iterable[tuple[str, torch.Tensor]], train: TrainConfig, fault: str = ""
) -> list[dict]:
    """AdamW's parameter groups of `named` (the module's named parameters, in its order): the decayed
    parameters at train.weight_decay, then the others at 0 (`by_kind`). With train.weight_decay 0
    there is nothing to tell apart, and the parameters are one group."""
    named = list(named)
    groups = []
    for decayed in (True, False):
        mine = [p for n, p in named if (decays(n, train, fault) or not train.weight_decay) == decayed]
        groups += by_kind(mine, train.weight_decay if decayed else 0.0)
    return groups


def by_kind(params: Iterable[torch.Tensor], weight_decay: float) -> list[dict]:
    """`params` as AdamW groups at `weight_decay`: plain tensors, then DTensors (a foreach or fused step
    takes one group's tensors in one op, which cannot mix them: the dtensor engine's replicated
    embedding beside its shards without VP); empty ones left out."""
    params = list(params)
    split = ([p for p in params if isinstance(p, DTensor) != plain] for plain in (True, False))
    return [{"params": mine, "weight_decay": weight_decay} for mine in split if mine]


def adamw(cfg: RunConfig, params: Iterable, lr: float) -> torch.optim.AdamW:
    """The run's AdamW over `params`: its groups (`param_groups`), or tensors, all at
    train.weight_decay. Fused under train.fused_optimizer; else foreach, AdamW's default for CUDA
    tensors, said here for an emulated GPU rank. One group at train.weight_decay is given as a plain
    list of tensors, as every run was built before the groups."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = by_kind(groups, cfg.train.weight_decay)
    single = len(groups) == 1 and groups[0]["weight_decay"] == cfg.train.weight_decay
    params = groups[0]["params"] if single else groups
    if cfg.train.fused_optimizer is True:  # an unresolved "auto" is not read as true
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.train.weight_decay, fused=True)
    foreach = True if cfg.launch.device == "cuda" else None
    return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.train.weight_decay, foreach=foreach)


def dense_adamw(train: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """Validation's AdamW of the dense model or its reference: torch's default kernel, the groups of
    train.no_decay (never a planted fault: that is the sharded side's)."""
    groups = param_groups(model.named_parameters(), train)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=train.weight_decay)


def lr_factor(step: int, train: TrainConfig, horizon: int) -> float:
    """torchtitan's factor of train.lr at 0-based `step` of a run of `horizon` steps (the module's
    docstring)."""
    s = train.lr_scheduler
    warmup = s.warmup_steps
    decay = horizon - warmup if s.decay_ratio is None else round(horizon * s.decay_ratio)
    decay = max(min(decay, horizon - warmup), 0)
    stable = horizon - warmup - decay
    step = min(step, warmup + stable + decay)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step < warmup + stable or decay == 0:
        return 1.0
    progress = (step + 1 - warmup - stable) / (decay + 1)
    if s.decay_type == "linear":
        left = 1 - progress
    elif s.decay_type == "sqrt":
        left = 1 - math.sqrt(progress)
    else:  # cosine
        left = 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_lr_factor + (1 - s.min_lr_factor) * left


def scheduler(
    train: TrainConfig, optimizer: torch.optim.Optimizer, horizon: int, fault: str = ""
) -> LambdaLR | None:
    """The LambdaLR of `optimizer` (a torch AdamW: ZeRO-1's of its shard included) for a run of
    `horizon` steps, to step after every optimizer step; None where the lr is constant. fault:
    debug.optim_fault, given on the side under test only (lr_ahead: its schedule one step ahead)."""
    if train.lr_scheduler.constant():
        return None
    ahead = 1 if fault == "lr_ahead" else 0
    return LambdaLR(optimizer, lambda step: lr_factor(step + ahead, train, horizon))
