"""Numerical validation: the parallel model against the dense model, at three levels.

Both are built from the same dense weights, run in the run's precision (`train.dtype`, `pure` or
`mixed` under autocast) and see the same tokens (the dense model the whole global batch, each DP rank
its slice):
1. forward: max |logits diff| (vocab-sharded logits are gathered for the check only), |loss diff|;
2. backward: per parameter, the error of the local gradient against the matching shard of the
   dense gradient, after the gradient sums (TP norms, KV replicas, DP average);
3. AdamW: N steps on both, each on a fresh batch (`validate.batch=fresh`) or all on the forward
   check's batch (`fixed`, the seed chapter's check); every k steps the logits' mean and max |diff|
   and relative L2 against dense, on a batch kept aside (fresh) or that same batch (fixed); final
   parameters compared, each rank's own against its shard of the dense model's.

Every figure is the worst over all ranks (each rank checks its own logits shard, DP slice, gradients
and parameters), so every rank reaches the same verdict, and an error on any one rank fails the run.
`mode=ddp` validates the DistributedDataParallel that memory and throughput measure (the same module,
comm hook and buckets: tpbench.experiments.training.build_ddp): each DP rank its slice, the hook
averaging the gradients, the dense model the whole batch.

The criterion holds in every dtype. A third model, the dense one in pure fp32, measures the dense
model's own rounding error in the run's precision (zero for a pure fp32 run). Each check passes when
the sharded-vs-dense error is at most max(tolerance, K x that error): the sharded model may round
like the dense one does, up to K times as much, and never needs to beat the absolute tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import io

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from tpbench.config import RunConfig, mode_label
from tpbench.experiments.progress import StepProgress
from tpbench.experiments.setup import (
    Batches,
    build_dense,
    build_parallel,
    context,
    counting,
    param_dtype,
    place,
    precision,
)
from tpbench.experiments.training import adamw, build_ddp
from tpbench.models.minimind import IGNORE_INDEX, MiniMindForCausalLM, shift_labels
from tpbench.parallel import collectives, instrumentation
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.plan import ParallelModel
from tpbench.predict import theory
from tpbench.results import ParamRow, RankResult

# How many times the dense model's own rounding error (in the run's precision, against fp32) the
# sharded model may be off the dense model. Two models that compute the same sums in different orders
# each carry an error e against the exact result, so their difference is up to about 2e; the sharded
# model rounds more often than the dense one (each rank's partial sums are rounded to the dtype before
# the all-reduce adds them). Measured on the tiny model at T = 2, every mode, bf16 pure and mixed
# (tests/test_parallel.py, MiniMind's fp32-scaled RMSNorm): the ratio is at most 0.93 for logits,
# 0.98 for gradients, 1.04 for the AdamW parameters and 0.07 for the loss (against its per-token
# scale, below). A missing gradient sum gives 50-64 (relative gradient error ~1 against bf16's
# ~2e-2). 10 sits between.
K = 10.0

# (metric, what it is, the ValidateConfig tolerance that is its floor, the dense model's own error)
# The loss is one scalar: the dense model's own error on it cancels by chance (2.9e-6 against a
# sharded-vs-dense 4.0e-5 at tp 2, mixed), so its scale is the mean over tokens of the dense model's
# |per-token loss error|, which bounds the scalar's error and cannot cancel.
CHECKS = (
    ("fwd_logits_max_abs", "forward max |logits diff|", "tol_fwd", "dense_fwd_logits_max_abs"),
    ("loss_abs_diff", "|loss diff|", "tol_loss", "dense_token_loss_mean_abs_diff"),
    ("grad_max_rel_l2", "max gradient relative L2", "tol_grad_rel", "dense_grad_max_rel_l2"),
    ("adamw_param_max_abs", "AdamW x{steps}: max |param diff|", "tol_param", "dense_adamw_param_max_abs"),
    ("adamw_drift_max_abs", "AdamW x{steps}: max |logits diff|, worst step", "tol_drift",
     "dense_adamw_drift_max_abs"),
)  # fmt: skip
# The logits drift against dense at each compared AdamW step, each the worst over ranks, stored per step
DRIFT = ("adamw_logits_mean_abs", "adamw_logits_max_abs", "adamw_logits_rel_l2")


def run(cfg: RunConfig) -> RankResult:
    ctx = context(cfg)
    dense = build_dense(cfg)
    pm = DDPModel(cfg, ctx) if cfg.parallel.engine == "ddp" else build_parallel(cfg, ctx, dense)
    pure_fp32 = cfg.train.dtype == "float32"  # mixed precision needs a 16-bit dtype (compose checks)
    reference = None if pure_fp32 else place(copy.deepcopy(dense), ctx.device, torch.float32)  # dense, fp32
    place(dense, ctx.device, param_dtype(cfg))
    batches = Batches(cfg, ctx)
    result = RankResult(rank=ctx.rank)

    # 1. forward and 2. backward, one step, with the collectives of a training step counted
    ids, labels = batches.next_global()
    with precision(cfg, ctx.device):
        dense_logits, dense_loss = dense(ids, labels)
    dense_loss.backward()
    ref_logits, ref_loss = dense_logits, dense_loss
    if reference is not None:
        ref_logits, ref_loss = reference(ids, labels)
        ref_loss.backward()
    counter = instrumentation.CommCounter()
    with counting(cfg, counter):
        with precision(cfg, ctx.device):
            logits, loss = pm(batches.local_slice(ids), batches.local_slice(labels))
            logits = logits.detach().clone()  # the vocab-parallel loss's backward writes over the logits
        loss.backward()
        pm.finish_grads()
    result.comm = counter.rows()
    result.add("comm_bytes_per_step", sum(r.bytes for r in result.comm), "B")
    result.add("predicted_comm_bytes_per_step", theory.predict(cfg).comm_bytes_per_step, "B")
    if cfg.train.compile:  # what Dynamo made of this model's blocks (fullgraph: no breaks)
        from torch._dynamo.utils import counters

        result.add("compile_graphs", counters["stats"]["unique_graphs"])
        result.add("compile_graph_breaks", sum(counters["graph_break"].values()))

    figures = {}  # this rank's; the result keeps each one's worst over all ranks
    figures["fwd_logits_max_abs"] = _max_abs(pm.full_logits(logits), batches.local_slice(dense_logits))
    mean_loss = collectives.all_reduce(loss.detach().float().clone(), ctx.dp_group, "check") / ctx.dp
    figures["loss_abs_diff"] = (mean_loss - dense_loss.detach().float()).abs().item()
    rows = _grad_rows(pm, dense)
    if ctx.rank == 0:
        result.params = rows
    figures["grad_max_abs"] = max(r.grad_max_abs for r in rows)
    figures["grad_max_rel_l2"] = max(r.grad_rel_l2 for r in rows)
    # the dense model's own error against fp32
    figures["dense_fwd_logits_max_abs"] = _max_abs(dense_logits, ref_logits)
    figures["dense_loss_abs_diff"] = (dense_loss.detach().float() - ref_loss.detach()).abs().item()
    figures["dense_token_loss_mean_abs_diff"] = _token_loss_error(dense_logits, ref_logits, labels)
    figures["dense_grad_max_rel_l2"] = _dense_grad_error(dense, reference)

    # 3. AdamW steps on all of them
    drift = _adamw(cfg, pm, dense, reference, batches, (ids, labels))
    _plant_error(cfg, pm)
    figures["adamw_param_max_abs"] = _param_error(pm, dense)
    figures["dense_adamw_param_max_abs"] = _dense_param_error(dense, reference)

    worst = _worst_over_ranks(figures)  # the drift's figures are the worst over ranks already
    worst["adamw_drift_max_abs"] = max(values[1] for _, values, _ in drift)
    worst["dense_adamw_drift_max_abs"] = max(own for *_, own in drift)
    for name, value in worst.items():
        result.add(name, value)
    for step, values, _ in drift:
        for name, value in zip(DRIFT, values, strict=True):
            result.add(name, value, step=step)
    verdicts = [_verdict(cfg, worst, *check) for check in CHECKS]
    passed = all(ok for *_, ok in verdicts)
    result.add("passed", float(passed))
    if ctx.rank == 0:
        result.failed = [
            f"{m} {value:.3g} > bound {bound:.3g}" for m, _, value, _, bound, ok in verdicts if not ok
        ]
        result.text = _table(cfg, verdicts, rows, passed)
    return result


class DDPModel:
    """The `ddp` engine as the checks take a parallel model: build_ddp's DistributedDataParallel, the
    one memory and throughput measure. Nothing is sharded (each rank holds the dense model and takes
    its DP slice of the batch); DDP's comm hook averages the gradients during backward."""

    def __init__(self, cfg: RunConfig, ctx: ParallelContext):
        self.ddp, _ = build_ddp(cfg, ctx)
        self.module: MiniMindForCausalLM = self.ddp.module

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.ddp(input_ids, labels)

    def finish_grads(self) -> None:
        """Nothing left: DDP waits for its buckets' all-reduces before backward returns."""

    def semantics(self, name: str) -> str:
        return "replicated"

    def shard_like(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        return dense.detach()

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _verdict(
    cfg: RunConfig, metrics: dict[str, float], metric: str, what: str, tol: str, own_metric: str
) -> tuple[str, str, float, float, float, bool]:
    """(metric, what, sharded-vs-dense error, dense-vs-fp32 error, bound, ok)."""
    value, own = metrics[metric], metrics[own_metric]
    bound = max(getattr(cfg.validate, tol), K * own)
    return metric, what, value, own, bound, value <= bound


def _token_loss_error(logits: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over the valid tokens of |cross entropy of `logits` - that of `reference`| (both [B, S, V],
    labels [B, S]): the per-token scale of the rounding error of the mean loss."""
    targets = shift_labels(labels).t().reshape(-1)  # [B S]

    def token_losses(x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().float().reshape(-1, x.shape[-1])
        return F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="none")

    valid = targets != IGNORE_INDEX
    return (token_losses(logits) - token_losses(reference)).abs()[valid].mean().item()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def logits_drift(logits: torch.Tensor, dense: torch.Tensor) -> list[float]:
    """The DRIFT figures of `logits` against `dense`: mean |diff|, max |diff| and the relative L2
    ||logits - dense|| / ||dense||, all in fp32 over every element."""
    a, b = logits.float(), dense.float()
    diff = a - b
    rel = diff.norm() / b.norm().clamp(min=1e-30)
    return [diff.abs().mean().item(), diff.abs().max().item(), rel.item()]


def _worst_over_ranks(figures: dict[str, float]) -> dict[str, float]:
    """Each figure's worst (largest) value over all ranks, in one all-reduce."""
    worst = collectives.reduce_floats(list(figures.values()), dist.ReduceOp.MAX)
    return dict(zip(figures, worst, strict=True))


def _grad_rows(pm: ParallelModel | DDPModel, dense: torch.nn.Module) -> list[ParamRow]:
    """Gradient error of every parameter against its shard of the dense gradient, worst over ranks."""
    dense_params = dict(dense.named_parameters())
    names, stats = [], []
    for name, p in pm.module.named_parameters():
        ref = pm.shard_like(name, dense_params[name].grad).float()
        diff = p.grad.float() - ref
        rel = diff.norm() / ref.norm().clamp(min=1e-30)
        names.append(name)
        stats.append(torch.stack([diff.abs().mean(), diff.abs().max(), rel]).double())
    stacked = collectives.reduce_over_world(torch.stack(stats), dist.ReduceOp.MAX).cpu()  # [params, 3]
    return [
        ParamRow(n, pm.semantics(n), list(p.shape), *map(float, s))
        for n, p, s in zip(names, pm.module.parameters(), stacked, strict=True)
    ]


def _param_error(pm: ParallelModel | DDPModel, dense: torch.nn.Module) -> float:
    """This rank's worst |param diff|: each of its parameters against its shard of the dense model's
    (every replica of a replicated weight counts, not only the one a checkpoint keeps)."""
    dense_params = dict(dense.named_parameters())
    return max(_max_abs(p, pm.shard_like(n, dense_params[n])) for n, p in pm.module.named_parameters())


def _dense_param_error(dense: torch.nn.Module, reference: torch.nn.Module | None) -> float:
    if reference is None:
        return 0.0
    ref = dict(reference.named_parameters())
    return max(_max_abs(p, ref[n]) for n, p in dense.named_parameters())


def _plant_error(cfg: RunConfig, pm: ParallelModel | DDPModel) -> None:
    """debug.validate_fault=rank1_param: rank 1 adds 1 to its copy of model.norm.weight (replicated in
    every mode, so no other rank's figures hold it), to prove that its figures count."""
    if cfg.debug.validate_fault == "rank1_param" and dist.get_rank() == 1:
        with torch.no_grad():
            dict(pm.module.named_parameters())["model.norm.weight"].view(-1)[0].add_(1.0)


def _dense_grad_error(dense: torch.nn.Module, reference: torch.nn.Module | None) -> float:
    """The dense model's worst relative L2 gradient error against the fp32 dense model's."""
    if reference is None:
        return 0.0
    ref = dict(reference.named_parameters())
    return max(
        ((p.grad.float() - ref[n].grad).norm() / ref[n].grad.norm().clamp(min=1e-30)).item()
        for n, p in dense.named_parameters()
    )


def _adamw(
    cfg: RunConfig,
    pm: ParallelModel | DDPModel,
    dense: torch.nn.Module,
    reference: torch.nn.Module | None,
    batches: Batches,
    first: tuple[torch.Tensor, torch.Tensor],
) -> list[tuple[int, list[float], float]]:
    """The AdamW steps; at every compared step (step, the DRIFT figures each the worst over ranks,
    the dense model's own max |logits diff| against the fp32 dense model's, 0 in pure fp32).
    validate.batch=fixed trains every step on `first`, the forward check's global batch, and
    compares on it; fresh draws a batch to compare on, then one per step."""
    v = cfg.validate
    models = [m for m in (dense, reference) if m is not None]
    opt_p = adamw(cfg, pm.module.parameters(), v.lr)  # fused under train.fused_optimizer
    dense_opts = [
        torch.optim.AdamW(m.parameters(), lr=v.lr, weight_decay=cfg.train.weight_decay) for m in models
    ]
    device = batches.device
    fixed = v.batch == "fixed"
    eval_ids = first[0] if fixed else batches.next_global()[0]
    ids, labels = first
    drift = []
    progress = StepProgress("validate", v.steps)
    for step in range(1, v.steps + 1):
        if not fixed:
            ids, labels = batches.next_global()
        for opt in (opt_p, *dense_opts):
            opt.zero_grad(set_to_none=True)
        for model in models:  # the fp32 reference runs without autocast
            with precision(cfg, device) if model is dense else contextlib.nullcontext():
                loss = model(ids, labels)[1]
            loss.backward()
        with precision(cfg, device):
            loss = pm(batches.local_slice(ids), batches.local_slice(labels))[1]
        loss.backward()
        pm.finish_grads()
        for opt in (opt_p, *dense_opts):
            opt.step()
        if step % v.every == 0 or step == v.steps:
            with torch.no_grad():
                with precision(cfg, device):
                    full = pm.full_logits(pm(batches.local_slice(eval_ids))[0])
                    ref = batches.local_slice(dense(eval_ids)[0])
                own = 0.0 if reference is None else _max_abs(ref, batches.local_slice(reference(eval_ids)[0]))
            worst = collectives.reduce_floats([*logits_drift(full, ref), own], dist.ReduceOp.MAX)
            drift.append((step, worst[:-1], worst[-1]))
        progress.step()
    return drift


def _table(cfg: RunConfig, verdicts: list[tuple], rows: list[ParamRow], passed: bool) -> str:
    p, t = cfg.parallel, cfg.train
    table = Table(title=f"validate {mode_label(p)}  tp={p.tp} dp={p.dp}  {t.dtype} {t.precision}")
    for col in ("check", "measured", "dense vs fp32", "bound", "ok"):
        table.add_column(col, justify="right" if col != "check" else "left")
    for _, what, value, own, bound, ok in verdicts:
        cells = (f"{value:.2e}", f"{own:.2e}", f"{bound:.1e}", "yes" if ok else "NO")
        table.add_row(what.format(steps=cfg.validate.steps), *cells)
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
    console.print(
        f"bound: max(tolerance, {K:g} x the dense model's own error against fp32); "
        f"verdict: {'PASSED' if passed else 'FAILED'}"
    )
    return out.getvalue()
