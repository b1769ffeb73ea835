"""The CUDA path without a GPU: this process is rank 0 of a job on torch's `cuda:fake` backend, with
every tensor made under FakeTensorMode on device "cuda" (a CPU-only torch runs the forward there).

    python tests/fake_cuda_checks.py OUT.json

A recording dispatch mode notes the device of every tensor handed to a collective; beneath it, as on
NCCL, a CPU tensor in a collective is refused. What a CPU-only torch cannot do on fake CUDA tensors,
for want of CUDA's device guard: record an autograd graph (the process aborts), copy_ into a tensor,
make a strided copy. So the model's own forward and backward are not run here (scripts/gpu-check.sh
runs them on a GPU); the checks run each collective of the run on tensors of the run's shapes: the
forward halves of the conjugate pairs, the vocab-parallel loss, the gradient sums (on gradients set by
hand, up to copying the sums back) and the metric reductions of validate and throughput.
The assertions live in tests/test_cuda_path.py.
"""

from __future__ import annotations

import json
import sys
import traceback
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
from tpbench.experiments.setup import build_parallel, context, precision
from tpbench.parallel import comm

WORLD = 4  # dp 2 x tp 2: the dp and tp sub-groups are both real groups of the fake backend
MODES = {
    "tp": ["parallel.tp=2"],
    "tp_sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp_vp": ["parallel.tp=2", "parallel.vp=true", "model.vocab_size=255"],  # padded vocab
    "tp_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
    "tp_sp_vp_kv1": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true", "model.num_key_value_heads=1"],
}
NO_GUARD = "not linked with support for cuda devices"  # a CPU-only torch copying on fake CUDA
PRECISIONS = {
    "bf16_pure": ["train.dtype=bfloat16"],
    "bf16_mixed": ["train.dtype=bfloat16", "train.precision=mixed"],
}


class CollectiveDevices(TorchDispatchMode):
    """Records (collective, devices of its tensors) for every c10d op dispatched beneath it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            leaves = tree_leaves((args, kwargs))
            devices = sorted({t.device.type for t in leaves if isinstance(t, torch.Tensor)})
            self.seen.append((func.__name__, devices))
        return func(*args, **(kwargs or {}))


def check_mode(overrides: list[str], recorder: CollectiveDevices) -> dict:
    """One mode on fake CUDA: its model placed there, its gradient sums, the forward halves of its
    conjugate collectives and its vocab-parallel loss on [S, B, H] / [S, B, V/T] tensors of the run."""
    cfg = run_config([*TINY, *overrides, "parallel.dp=2"])
    cfg.launch.device = "cuda"
    ctx = context(cfg)  # the mesh is built outside fake mode: it reads the store
    seen: dict = {}
    S, B, H = cfg.train.seq_len, cfg.train.micro_batch, cfg.model.hidden_size
    with FakeTensorMode(shape_env=ShapeEnv()), recorder:
        autocast = precision(cfg, ctx.device)
        seen["autocast_device"] = autocast.device if isinstance(autocast, torch.autocast) else None
        pm = build_parallel(cfg, ctx)
        seen["params"] = sorted({p.device.type for p in pm.module.parameters()})
        for p in pm.module.parameters():
            p.grad = torch.empty_like(p)
        try:
            pm.finish_grads()
        except RuntimeError as e:  # the all-reduce is issued; copying the sums back needs CUDA's guard
            if NO_GUARD not in str(e):
                raise
        g = ctx.tp_group
        with torch.no_grad():
            x = torch.empty(S, B, H, device="cuda", dtype=torch.bfloat16)
            shard = comm.scatter_to_sp_region(x, g)
            for op in (comm.copy_to_tp_region, comm.reduce_from_tp_region, comm.reduce_scatter_to_sp_region):
                op(x, g)
            for op in (comm.gather_from_sp_region, comm.gather_from_sp_region_replicated):
                op(shard, g)
            if cfg.parallel.vp:
                v_local = pm.module.lm_head.weight.shape[0]
                logits = torch.empty(S, B, v_local, device="cuda", dtype=torch.bfloat16)
                targets = torch.zeros(S, B, dtype=torch.long, device="cuda")
                try:
                    seen["loss"] = pm.module.loss_fn(logits, targets).device.type
                except RuntimeError as e:  # past its first all-reduce, the loss needs CUDA's guard
                    if NO_GUARD not in str(e):
                        raise
    return seen


def check_reductions(recorder: CollectiveDevices) -> None:
    """The metric reductions of validate and throughput, as their experiments call them."""
    with FakeTensorMode(shape_env=ShapeEnv()), recorder:
        validate._max_over_ranks(0.5)
        validate._worst_over_ranks(torch.zeros(3, 3, dtype=torch.float64, device="cuda"))
        throughput._summed_over_ranks(1.0)


def main(out: Path) -> None:
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=WORLD)
    results: dict = {"modes": {}, "errors": {}}
    for name, overrides in [("reductions", None)] + [
        (f"{mode}/{prec}", [*m, *p]) for mode, m in MODES.items() for prec, p in PRECISIONS.items()
    ]:
        recorder = CollectiveDevices()
        try:
            if overrides is None:
                check_reductions(recorder)
                results["modes"][name] = {}
            else:
                results["modes"][name] = check_mode(overrides, recorder)
        except Exception:  # the assertions read the traceback
            results["errors"][name] = traceback.format_exc(limit=-4)
        results["modes"].setdefault(name, {})["collectives"] = recorder.seen
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
