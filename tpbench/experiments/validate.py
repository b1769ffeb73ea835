"""Numerical validation: the parallel model against the dense model, at three levels.

Both are built from the same dense weights and see the same tokens (the dense model the whole
global batch, each DP rank its slice):
1. forward: max |logits diff| (vocab-sharded logits are gathered for the check only), |loss diff|;
2. backward: per parameter, the error of the local gradient against the matching shard of the
   dense gradient, after the gradient sums (TP norms, KV replicas, DP average);
3. AdamW: N steps on both; logits on a fixed batch compared every k steps; final parameters
   (gathered back into a dense state dict) compared.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from tpbench import theory
from tpbench.config import RunConfig, mode_label
from tpbench.experiments.setup import (
    Batches,
    build_dense,
    build_parallel,
    context,
    counting,
    param_dtype,
    place,
)
from tpbench.parallel import comm
from tpbench.parallel.plan import ParallelModel
from tpbench.results import ParamRow, RankResult


def run(cfg: RunConfig) -> RankResult:
    ctx = context(cfg)
    dense = build_dense(cfg)
    pm = build_parallel(cfg, ctx, dense)
    place(dense, ctx.device, param_dtype(cfg))
    batches = Batches(cfg, ctx)
    result = RankResult(rank=ctx.rank)

    # 1. forward and 2. backward, one step, with the collectives of a training step counted
    ids, labels = batches.next_global()
    dense_logits, dense_loss = dense(ids, labels)
    dense_loss.backward()
    counter = comm.CommCounter()
    with counting(cfg, counter):
        logits, loss = pm(batches.local_slice(ids), batches.local_slice(labels))
        loss.backward()
        pm.finish_grads()
    result.comm = counter.rows()
    result.add("comm_bytes_per_step", sum(r.bytes for r in result.comm), "B")
    result.add("predicted_comm_bytes_per_step", theory.predict(cfg).comm_bytes_per_step, "B")

    fwd = _max_abs(pm.full_logits(logits), batches.local_slice(dense_logits))
    mean_loss = comm.all_reduce(loss.detach().clone(), ctx.dp_group, "check") / ctx.dp
    result.add("fwd_logits_max_abs", _max_over_ranks(fwd))
    result.add("loss_abs_diff", (mean_loss - dense_loss).abs().item())
    rows = _grad_rows(pm, dense)
    if ctx.rank == 0:
        result.params = rows
    result.add("grad_max_abs", max(r.grad_max_abs for r in rows))
    result.add("grad_max_rel_l2", max(r.grad_rel_l2 for r in rows))

    # 3. AdamW steps on both
    drift = _adamw(cfg, pm, dense, batches)
    for step, value in drift:
        result.add("adamw_logits_max_abs", value, step=step)
    dense_sd = dense.state_dict()
    param_diff = max(_max_abs(t, dense_sd[n]) for n, t in pm.state_dict().items())
    result.add("adamw_param_max_abs", param_diff)

    v = cfg.validate
    metrics = {m.name: m.value for m in result.measurements if m.step is None}
    passed = (
        metrics["fwd_logits_max_abs"] <= v.tol_fwd
        and metrics["loss_abs_diff"] <= v.tol_loss
        and metrics["grad_max_rel_l2"] <= v.tol_grad_rel
        and param_diff <= v.tol_param
    )
    result.add("passed", float(passed))
    if ctx.rank == 0:
        result.text = _table(cfg, metrics, rows, passed)
    return result


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _max_over_ranks(value: float) -> float:
    """The worst value over all ranks (every rank checks its own logits shard and DP slice)."""
    return comm.reduce_floats([value], dist.ReduceOp.MAX)[0]


def _worst_over_ranks(stats: torch.Tensor) -> torch.Tensor:
    """Element-wise max over every rank, issued on the device the backend serves."""
    return comm.reduce_over_world(stats, dist.ReduceOp.MAX)


def _grad_rows(pm: ParallelModel, dense: torch.nn.Module) -> list[ParamRow]:
    """Gradient error of every parameter against its shard of the dense gradient, worst over ranks."""
    dense_params = dict(dense.named_parameters())
    names, stats = [], []
    for name, p in pm.module.named_parameters():
        ref = pm.shard_like(name, dense_params[name].grad).float()
        diff = p.grad.float() - ref
        rel = diff.norm() / ref.norm().clamp(min=1e-30)
        names.append(name)
        stats.append(torch.stack([diff.abs().mean(), diff.abs().max(), rel]).double())
    stacked = _worst_over_ranks(torch.stack(stats)).cpu()  # [params, 3]
    return [
        ParamRow(n, pm.semantics(n), list(p.shape), *map(float, s))
        for n, p, s in zip(names, pm.module.parameters(), stacked, strict=True)
    ]


def _adamw(
    cfg: RunConfig, pm: ParallelModel, dense: torch.nn.Module, batches: Batches
) -> list[tuple[int, float]]:
    v = cfg.validate
    opt_p = torch.optim.AdamW(pm.module.parameters(), lr=v.lr, weight_decay=cfg.train.weight_decay)
    opt_d = torch.optim.AdamW(dense.parameters(), lr=v.lr, weight_decay=cfg.train.weight_decay)
    eval_ids, _ = batches.next_global()
    drift = []
    for step in range(1, v.steps + 1):
        ids, labels = batches.next_global()
        for opt in (opt_p, opt_d):
            opt.zero_grad(set_to_none=True)
        dense(ids, labels)[1].backward()
        pm(batches.local_slice(ids), batches.local_slice(labels))[1].backward()
        pm.finish_grads()
        opt_d.step()
        opt_p.step()
        if step % v.every == 0 or step == v.steps:
            with torch.no_grad():
                full = pm.full_logits(pm(batches.local_slice(eval_ids))[0])
                ref = batches.local_slice(dense(eval_ids)[0])
            drift.append((step, _max_over_ranks(_max_abs(full, ref))))
    return drift


def _table(cfg: RunConfig, metrics: dict[str, float], rows: list[ParamRow], passed: bool) -> str:
    p = cfg.parallel
    v = cfg.validate
    table = Table(title=f"validate {mode_label(p)}  tp={p.tp} dp={p.dp}  {cfg.train.dtype}")
    for col in ("check", "measured", "tolerance", "ok"):
        table.add_column(col, justify="right" if col != "check" else "left")
    checks = [
        ("forward max |logits diff|", metrics["fwd_logits_max_abs"], v.tol_fwd),
        ("|loss diff|", metrics["loss_abs_diff"], v.tol_loss),
        ("max gradient relative L2", metrics["grad_max_rel_l2"], v.tol_grad_rel),
        (f"AdamW x{v.steps}: max |param diff|", metrics["adamw_param_max_abs"], v.tol_param),
    ]
    for name, value, tol in checks:
        table.add_row(name, f"{value:.2e}", f"{tol:.0e}", "yes" if value <= tol else "NO")
    by_sem = Table(title="gradient error by semantics")
    for col in ("semantics", "params", "max |diff|", "max rel L2"):
        by_sem.add_column(col, justify="right" if col != "semantics" else "left")
    for sem in sorted({r.semantics for r in rows}):
        group = [r for r in rows if r.semantics == sem]
        by_sem.add_row(
            sem,
            str(len(group)),
            f"{max(r.grad_max_abs for r in group):.2e}",
            f"{max(r.grad_rel_l2 for r in group):.2e}",
        )
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=False)
    console.print(table)
    console.print(by_sem)
    console.print(f"verdict: {'PASSED' if passed else 'FAILED'}")
    return out.getvalue()
