"""The CUDA path without a GPU: this process is rank 0 of a job on torch's `cuda:fake` backend, every
tensor made under FakeTensorMode on device "cuda", and it runs tpbench's own training step there.

    LD_PRELOAD=$(cuda_guard.build()) python tests/fake_cuda_checks.py OUT.json [CASE ...]

A CPU-only torch cannot run backward, copies or AdamW on fake CUDA tensors (no CUDA device guard, no
accelerator): tests/cuda_guard is a no-op CUDA that must be loaded before torch, hence the preload.
For each mode and switch (CASES) the run's Trainer is built as the worker builds it for device=cuda
(mesh, model, placement, AdamW with foreach as on CUDA) and runs two steps (forward, backward, the
gradient sums, AdamW: the first makes AdamW's state, the second uses it). `DeviceAudit`, above
FakeTensorMode, refuses a CPU tensor handed to a collective as NCCL would (the case fails there: the
`cuda:fake` backend refuses real CPU tensors only, and FakeTensorMode answers collectives on fake
tensors itself, never reaching it), and notes the devices of every collective's tensors, any op that
mixes CPU and CUDA tensors (0-dim CPU tensors aside: scalars, such as AdamW's step counters; beneath,
FakeTensorMode raises for those too), every CPU tensor made and every copy to the host (a scalar's
too: a sync on a GPU); the case then records where each parameter, gradient and optimizer state
lives, the last step's collectives as a memory run counts them, and how many bitwise xors ran
(dropout's mask hashes). The assertions live in tests/test_cuda_path.py.

torch.autocast("cuda") disables itself where torch.cuda.is_available() is False (here), and mixed
precision would run fp32 unseen: main() tells it a GPU with bf16 is there. train.compile is not a
case: inductor allocates real CUDA buffers while it compiles (a CPU-only torch has no CUDA kernel for
`empty`), and Dynamo traces nothing under a dispatch mode such as DeviceAudit.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torchrun_checks import TINY, run_config

from tpbench.experiments import throughput, validate
from tpbench.experiments.setup import context, counting
from tpbench.experiments.training import Trainer
from tpbench.parallel import collectives, instrumentation
from tpbench.parallel.checks import resolve_switches

WORLD = 4  # dp 2 x tp 2: the dp and tp sub-groups are both real groups of the fake backend
TP2 = ["parallel.tp=2", "parallel.dp=2"]
SP, VP, LINEAR = ["parallel.sp=true"], ["parallel.vp=true"], ["parallel.sp_gather=linear"]
MODES = {
    "ddp": ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=4"],
    "tp": TP2,
    "tp_sp": [*TP2, *SP],
    "tp_sp_linear": [*TP2, *SP, *LINEAR],
    "tp_vp": [*TP2, *VP, "model.vocab_size=255"],  # a padded vocabulary
    "tp_sp_vp": [*TP2, *SP, *VP],
    "tp_sp_linear_vp": [*TP2, *SP, *LINEAR, *VP],
    "tp_sp_vp_kv1": [*TP2, *SP, *VP, "model.num_key_value_heads=1"],  # a replicated KV head
    "dtensor_tp": ["parallel.engine=dtensor", *TP2],
    "dtensor_tp_sp": ["parallel.engine=dtensor", *TP2, *SP],
    "dtensor_tp_vp": ["parallel.engine=dtensor", *TP2, *VP],
    "dtensor_tp_sp_vp": ["parallel.engine=dtensor", *TP2, *SP, *VP],
}
SWITCHES = {
    "overlap": ["parallel.overlap=true"],
    "recompute_selective": ["train.recompute=selective"],
    "recompute_full": ["train.recompute=full"],
    "foreach_adamw": ["train.fused_optimizer=false"],  # fused is the CUDA default (auto)
    "logits_mean_keep_output": ["train.loss=logits_mean", "train.keep_output=true"],
    "flash": ["model.flash_attn=true"],
    "dropout": ["model.dropout=0.1"],  # TINY's attention is manual already, as dropout needs
    "no_regather": ["parallel.sp_regather=false"],
}
PRECISIONS = {
    "fp32": [],
    "bf16_pure": ["train.dtype=bfloat16"],
    "bf16_mixed": ["train.dtype=bfloat16", "train.precision=mixed"],
}
# Every mode in bf16 (pure: parameters, gradients and AdamW's state in bf16), four in mixed precision
# (fp32 masters, autocast on cuda); each switch on two or three modes, pure and mixed between them.
_CASES = [
    *((mode, (), "bf16_pure") for mode in MODES),
    *((mode, (), "bf16_mixed") for mode in ("ddp", "tp", "tp_sp_vp", "dtensor_tp_sp_vp")),
    ("tp_sp_vp", (), "fp32"),
    ("tp", ("overlap",), "bf16_mixed"),
    ("tp_sp_linear_vp", ("overlap", "no_regather"), "bf16_pure"),
    ("ddp", ("recompute_selective",), "bf16_pure"),
    ("tp_sp_vp", ("recompute_selective", "dropout"), "bf16_mixed"),
    ("dtensor_tp", ("recompute_selective",), "bf16_pure"),
    ("ddp", ("recompute_full", "dropout"), "bf16_mixed"),
    ("tp_sp_vp", ("recompute_full",), "bf16_pure"),
    ("dtensor_tp_sp_vp", ("recompute_full", "dropout"), "bf16_mixed"),
    ("tp_sp_vp", ("overlap", "recompute_selective"), "bf16_mixed"),
    ("tp_sp_vp", ("foreach_adamw", "no_regather"), "bf16_pure"),
    ("dtensor_tp", ("foreach_adamw",), "bf16_mixed"),
    ("ddp", ("logits_mean_keep_output",), "bf16_mixed"),
    ("tp_sp_vp", ("logits_mean_keep_output",), "bf16_pure"),
    ("ddp", ("flash",), "bf16_pure"),
    ("tp_sp_vp", ("flash",), "bf16_mixed"),
]
CASES = {
    "+".join((mode, *switches)) + f"/{prec}": [
        *MODES[mode],
        *(o for s in switches for o in SWITCHES[s]),
        *PRECISIONS[prec],
    ]
    for mode, switches, prec in _CASES
}
STEPS = 2


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _devices(tensors) -> list[str]:
    return sorted({t.device.type for t in tensors})


class DeviceAudit(TorchDispatchMode):
    """Above FakeTensorMode: what each op dispatched in it was handed and made, by device."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[tuple[str, list[str]]] = []  # (c10d op, devices of its tensors)
        self.mixed: list[str] = []  # ops handed CPU and CUDA tensors (0-dim CPU tensors aside)
        self.cpu_made: Counter[str] = Counter()  # ops that made a CPU tensor of one or more dims
        self.to_host: list[str] = []  # ops that made a CPU tensor (any, a scalar too) from a CUDA one
        self.xors = 0  # bitwise xors: the dropout masks' hashes (tpbench.models.dropout); VP masks by and/or

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        given = _tensors((args, kwargs))
        if func.namespace in ("c10d", "_c10d_functional"):
            self.collectives.append((func.__name__, _devices(given)))
            if any(t.device.type == "cpu" for t in given):
                raise RuntimeError(f"{func.__name__} handed a CPU tensor: NCCL refuses it")
        if {"cpu", "cuda"} <= set(
            _devices(t for t in given if not (t.device.type == "cpu" and t.dim() == 0))
        ):
            self.mixed.append(func.__name__)
        out = func(*args, **(kwargs or {}))
        self.xors += func.__name__.startswith("bitwise_xor")
        made = [t for t in _tensors(out) if t.device.type == "cpu"]
        if any(t.dim() > 0 for t in made):
            self.cpu_made[func.__name__] += 1
        if made and any(t.device.type == "cuda" for t in given):
            self.to_host.append(func.__name__)
        return out


def _where(trainer: Trainer) -> dict:
    """Devices of the module's parameters, of their gradients and of AdamW's state (by key)."""
    params = list(trainer.module.parameters())
    state: dict[str, set[str]] = {}
    for s in trainer.optimizer.state.values():
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                state.setdefault(key, set()).add(value.device.type)
    return {
        "params": _devices(params),
        "grads": _devices(p.grad for p in params if p.grad is not None),
        "grads_missing": sum(p.grad is None for p in params if p.requires_grad),
        "optimizer": {key: sorted(devices) for key, devices in sorted(state.items())},
        "optimizer_states": len(trainer.optimizer.state),
        "params_count": len(params),
    }


def check_case(overrides: list[str]) -> dict:
    """Two training steps of the run's Trainer, device=cuda, on fake CUDA tensors."""
    cfg = run_config([*TINY, *overrides])
    cfg.launch.device = "cuda"
    if "train.fused_optimizer=false" not in overrides:  # auto, as compose resolves it on CUDA: fused
        cfg.train.fused_optimizer = "auto"
    resolve_switches(cfg)
    ctx = context(cfg)  # on cuda:0; the mesh is built outside fake mode: it reads the store
    cfg.launch.emulate = "fake"  # the tensors are fake: DDP keeps its first buckets (it cannot read them)
    seen: dict = {"device": str(ctx.device)}
    with FakeTensorMode():
        audit = DeviceAudit()
        with audit:
            trainer = Trainer(cfg, ctx)
        seen["build_mixed"], seen["build_collectives"] = audit.mixed, audit.collectives
        batch = DeviceAudit()  # what the batches alone make on the host (seeded CPU generator)
        with batch:
            trainer.batches.next_local()
        trainer.batches = type(trainer.batches)(cfg, ctx)  # the same batches again for the steps
        audit, counter, losses = DeviceAudit(), instrumentation.CommCounter(), []
        with audit:
            for step in range(STEPS):  # the last step's collectives counted, as a memory run counts them
                with counting(cfg, counter) if step == STEPS - 1 else contextlib.nullcontext():
                    losses.append(trainer.step())
        seen["loss"] = _devices(losses)
        seen["comm"] = sorted([c.op, c.purpose, c.count, c.bytes] for c in counter.rows())
        seen["xors"] = audit.xors
        seen["collectives"], seen["mixed"], seen["to_host"] = audit.collectives, audit.mixed, audit.to_host
        seen["cpu_made"] = dict(audit.cpu_made)
        seen["cpu_made_by_batches"] = {op: n * STEPS for op, n in batch.cpu_made.items()}
        seen |= _where(trainer)
        seen["foreach"] = trainer.optimizer.defaults.get("foreach")
        seen["fused"] = trainer.optimizer.defaults.get("fused")
    return seen


def check_reductions() -> dict:
    """The metric reductions of validate and throughput, as their experiments call them."""
    audit = DeviceAudit()
    with FakeTensorMode(shape_env=ShapeEnv()), audit:  # their `item()`: symbolic
        # a compared step's drift (mean, max, rel L2, the dense model's own), reduced as _adamw does
        collectives.reduce_floats([0.1, 0.5, 0.01, 0.0], dist.ReduceOp.MAX)
        validate._worst_over_ranks({"fwd": 0.5, "param": 1.0})  # every figure of the verdict
        collectives.reduce_over_world(
            torch.zeros(3, 3, dtype=torch.float64, device="cuda"), dist.ReduceOp.MAX
        )
        throughput._summed_over_ranks(1.0)
    return {"collectives": audit.collectives, "mixed": audit.mixed}


def main(out: Path, names: list[str]) -> None:
    if torch._C._accelerator_getAccelerator() != torch.device("cuda"):
        sys.exit("no CUDA here: run with tests/cuda_guard preloaded (LD_PRELOAD), see the docstring")
    # torch.autocast("cuda") asks torch.cuda.is_available(), False here, and then silently runs fp32:
    # mixed precision autocasts as on a GPU with bf16 (Ampere and later)
    torch.cuda.amp.common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda including_emulation=True: True
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=WORLD)
    results: dict = {"cases": {}, "errors": {}, "seconds": {}}
    for name in names or ["reductions", *CASES]:
        start = time.perf_counter()
        try:
            results["cases"][name] = check_reductions() if name == "reductions" else check_case(CASES[name])
        except Exception:  # the assertions read the traceback
            results["errors"][name] = traceback.format_exc(limit=-6)
        results["seconds"][name] = round(time.perf_counter() - start, 2)
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
