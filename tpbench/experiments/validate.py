"""Numerical validation: the parallel model against the dense model, at three levels.

Both are built from the same dense weights, run in the run's precision (`train.dtype`, `pure` or
`mixed` under autocast) and see the same tokens (the dense model the whole global batch, each DP rank
its slice; under train.accumulation=K its slice is K micro-batches, taken as a training step takes
them: `_accumulated`). Each check says what it forces; nothing forced is fed back into a model that
runs free (issue 56: the sign rule that wrote the dense gradient into the sharded one is gone):
1. forward, at the first step: max |logits diff| (vocab-sharded logits are gathered for the check
   only), |loss diff|;
2. gradients at every AdamW step, at the same weights: the sharded model and a copy of the reference
   take the dense model's current weights (each rank its part: tpbench.experiments.same_weights),
   run the step's forward and backward, and per parameter the relative L2 error of the local
   gradient against its shard of the dense gradient, after the gradient sums (TP norms, KV
   replicas, DP average), and of its worst row (a head, a vocabulary row: grad_check); the sharded
   model then has its own weights back. Per parameter the worst step's, and which step; per step
   the worst (`step_grad_*` curves). A bug that starts at any step fails at that step;
   with train.grad_clip also the global norm against clip_grad_norm_'s (clip_check: how each side clips);
3. the seed's free-running check: N AdamW steps, each model on its own from the same start, each on
   a fresh batch (`validate.batch=fresh`) or all on the forward check's batch (`fixed`, the seed
   chapter's check); every k steps the logits' mean and max |diff| and relative L2 against dense, on
   a batch kept aside (fresh) or that same batch (fixed); per parameter, the final difference
   against the dense model's, relative to how far the dense model's parameter moved
   (||sharded - dense|| / ||dense - initial||), each rank's own against its shard. Its bound is a
   wide multiple of the reference's own free-running drift (criterion.FREE_K: why).

Every figure is the worst over all ranks (each rank checks its own logits shard, DP slice, gradients
and parameters), so every rank reaches the same verdict, and an error on any one rank fails the run.
`mode=ddp` validates the DistributedDataParallel that memory and throughput measure (the same module,
comm hook and buckets: tpbench.experiments.training.build_ddp): each DP rank its slice, the hook
averaging the gradients, the dense model the whole batch.

One criterion holds for every check, in every precision (tpbench.experiments.criterion): the
sharded-vs-dense figure is at most k x the same figure of the dense model against a reference +
the check's floor. The reference is a third model stepped beside them, the dense model one precision
up (fp64 for an fp32 run, pure fp32 for bf16 and mixed): its difference from the dense model is the
run's own rounding drift, measured on the same weights, tokens and steps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tpbench.config import RunConfig
from tpbench.experiments import criterion, grad_check, optimizer_check, planted, reduce_check, same_weights
from tpbench.experiments.clip_check import NormSteps, clip_dense, clip_sharded, count_norm, dense_side
from tpbench.experiments.optim import dense_adamw, scheduler
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
from tpbench.experiments.training import DDPModel, optimizer, set_gradient_sync, shard_data_parallel
from tpbench.models import gemm
from tpbench.models.minimind import MiniMindForCausalLM
from tpbench.parallel import collectives, instrumentation
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.plan import ParallelModel
from tpbench.parallel.zero import ZeroModel
from tpbench.predict import theory
from tpbench.results import ParamRow, RankResult

# ParamRow's fields of the parameters after the AdamW steps (validate._param_errors)
PARAM_FIELDS = ("param_max_abs", "param_rel_l2", "param_ref_rel_l2")
# The logits drift against dense at each compared AdamW step, each the worst over ranks, stored per step
DRIFT = ("adamw_logits_mean_abs", "adamw_logits_max_abs", "adamw_logits_rel_l2")


def reference_dtype(cfg: RunConfig) -> torch.dtype:
    """The reference model's precision: one up from the run's (fp64 for fp32, fp32 for bf16/fp16)."""
    return torch.float64 if cfg.train.dtype == "float32" else torch.float32


def run(cfg: RunConfig) -> RankResult:
    """The three levels of checks for one parallel model (`run_beside` with one config)."""
    return run_beside([cfg])[0]


def run_beside(cfgs: Sequence[RunConfig]) -> list[RankResult]:
    """The three levels of checks for each config's parallel model, all against one dense model and
    one reference, stepped once for them all: the configs share a `dense_key`. Every GEMM runs under
    launch.bf16_gemm (tpbench.models.gemm: fp32_accumulate records a run's bf16 GEMMs, its own
    and the dense side's, as a run alone counts them). A model's figures are those of a run of its
    own, to the bit (tests/test_warm.py): each model's work reads the dense side, nothing of the
    others'. The dense side is most of a run's CPU: 9 modes at the seed's check shape beside one
    cost 2.9x less than 9 alone (docs/results/validation.md). Each rank records its CPU time
    (`validate_cpu_s`: its model's own work and its share of the dense side, what a grid of runs
    costs whatever the load) and how many runs shared the dense side (`validate_shared_by`)."""
    cpu = time.process_time()
    with gemm.bf16_gemms(cfgs[0].launch.bf16_gemm) as mode:
        checked = _run(cfgs, mode)
        total_gemms = mode.count if mode is not None else 0
    shared = time.process_time() - cpu - sum(c.cpu for c in checked)
    shared_gemms = total_gemms - sum(c.gemms for c in checked)
    for c in checked:
        if mode is not None:
            c.result.add("bf16_gemms_fp32_accumulated", c.gemms + shared_gemms)
        c.result.add("validate_cpu_s", c.cpu + shared / len(checked), "s")
        c.result.add("validate_shared_by", len(checked))
    return [c.result for c in checked]


@dataclass
class _Checked:
    """One parallel model under validation and what its checks gather; `own()` times its own work
    (CPU seconds and bf16 GEMMs), apart from the dense side's."""

    cfg: RunConfig
    pm: ParallelModel | DDPModel
    result: RankResult
    mode: gemm.Fp32Accumulate | None
    cpu: float = 0.0
    gemms: int = 0
    figures: dict[str, float] = field(default_factory=dict)  # this rank's: each one's worst is kept
    grads: grad_check.WorstSteps | None = None
    drift: list[tuple[int, list[float], float]] = field(default_factory=list)
    opt: Any = None
    updates: optimizer_check.WorstSteps | None = None  # the optimizer on identical inputs, every step
    reduce: reduce_check.WorstSteps | None = None  # the DP reduction on identical inputs (DP > 1)
    norms: NormSteps = field(default_factory=NormSteps)  # train.grad_clip: the global norm, every step

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        cpu, gemms = time.process_time(), self._gemms()
        try:
            yield
        finally:
            self.cpu += time.process_time() - cpu
            self.gemms += self._gemms() - gemms

    def _gemms(self) -> int:
        return self.mode.count if self.mode is not None else 0


def _parallel(cfg: RunConfig, ctx: ParallelContext, dense: MiniMindForCausalLM) -> ParallelModel | DDPModel:
    cfg = planted.built(cfg)
    if cfg.parallel.engine == "ddp" and cfg.parallel.dp_shard == "none":
        return DDPModel(cfg, ctx)
    return shard_data_parallel(cfg, build_parallel(cfg, ctx, dense), cfg.validate.lr)


def _run(cfgs: Sequence[RunConfig], mode: gemm.Fp32Accumulate | None) -> list[_Checked]:
    first = cfgs[0]
    ctx = context(first)
    dense = build_dense(first)
    checked = []
    for cfg in cfgs:
        c = _Checked(cfg, None, RankResult(rank=ctx.rank), mode)  # type: ignore[arg-type]
        with c.own():
            c.pm = _parallel(cfg, ctx, dense)
        checked.append(c)
    reference = place(copy.deepcopy(dense), ctx.device, reference_dtype(first))
    place(dense, ctx.device, param_dtype(first))
    for c in checked:
        planted.plant_model_fault(c.cfg, c.pm, ctx)
    batches = Batches(first, ctx)

    # 1. forward, with the collectives of a training step counted (its gradients are step 1's)
    ids, labels = batches.next_global()
    with torch.no_grad():
        with precision(first, ctx.device):
            dense_logits, dense_loss = dense(ids, labels)
        ref_logits, ref_loss = reference(ids, labels)
    dense_figures = {  # the dense model's own error against the reference
        "dense_fwd_logits_max_abs": _max_abs(dense_logits, ref_logits),
        "dense_loss_abs_diff": (dense_loss.detach().double() - ref_loss.detach().double()).abs().item(),
        "dense_token_loss_mean_abs_diff": criterion.token_loss_error(dense_logits, ref_logits, labels),
    }
    for c in checked:
        with c.own():
            _first_step(c, ctx, batches, (ids, labels), (dense_logits, dense_loss), dense_figures)
            c.grads = grad_check.WorstSteps(c.cfg.validate.k, c.cfg.validate.tol_grad_rel)

    # 2. and 3. AdamW steps on all of them, the gradients checked at each at the dense weights
    initial = {n: p.detach().clone() for n, p in dense.named_parameters()}
    _adamw(first, checked, dense, reference, batches, (ids, labels))
    for c in checked:
        with c.own():
            _verdicts(c, dense, reference, initial)
    return checked


def _first_step(
    c: _Checked,
    ctx: ParallelContext,
    batches: Batches,
    batch: tuple[torch.Tensor, torch.Tensor],
    dense_out: tuple[torch.Tensor, torch.Tensor],
    dense_figures: dict[str, float],
) -> None:
    """The parallel model's first step, its collectives counted, and its forward figures."""
    cfg, pm, result = c.cfg, c.pm, c.result
    counter = instrumentation.CommCounter()
    with counting(cfg, counter):
        logits, loss = _accumulated(cfg, pm, batches, *batch)
        count_norm(cfg, pm)
    result.comm = counter.rows()
    result.add("comm_bytes_per_step", sum(r.bytes for r in result.comm), "B")
    result.add("predicted_comm_bytes_per_step", theory.predict(cfg).comm_bytes_per_step, "B")
    if cfg.train.compile is True:  # what Dynamo makes of this model's blocks, at any step (fullgraph)
        from tpbench.parallel.compiled import record_graphs

        record_graphs(pm.module, result)

    dense_logits, dense_loss = dense_out
    full_logits = torch.cat([pm.full_logits(micro) for micro in logits])  # [K b, S, V]
    c.figures["fwd_logits_max_abs"] = _max_abs(full_logits, batches.local_slice(dense_logits))
    mean_loss = collectives.all_reduce(loss.detach().float().clone(), ctx.dp_group, "check") / ctx.dp
    c.figures["loss_abs_diff"] = (mean_loss - dense_loss.detach().float()).abs().item()
    c.figures.update(dense_figures)


def _verdicts(
    c: _Checked, dense: torch.nn.Module, reference: torch.nn.Module, initial: dict[str, torch.Tensor]
) -> None:
    """After the AdamW steps: the parameters' figures, every figure's worst over the ranks, the
    verdicts, all in the model's result."""
    cfg, pm, result = c.cfg, c.pm, c.result
    planted.plant_error(cfg, pm)
    params = _param_errors(pm, dense, reference, initial)
    rows = _rows(pm, c.grads, params)
    for step, largest, of_bound in c.grads.curve:
        result.add("step_grad_max_rel_l2", largest, step=step)
        result.add("step_grad_of_bound", of_bound, step=step)
    if result.rank == 0:
        result.params = rows
    c.figures["adamw_param_max_abs"] = max(r.param_max_abs for r in rows)  # the seed chapter's figure

    worst = _worst_over_ranks(c.figures)  # the drift's figures are the worst over ranks already
    worst["grad_max_abs"] = max(r.grad_max_abs for r in rows)
    worst["grad_max_rel_l2"] = max(r.grad_rel_l2 for r in rows)
    worst["dense_grad_max_rel_l2"] = max(r.grad_ref_rel_l2 for r in rows)
    worst["adamw_param_max_rel_l2"] = max(r.param_rel_l2 for r in rows)
    worst["dense_adamw_param_max_rel_l2"] = max(r.param_ref_rel_l2 for r in rows)
    worst["adamw_drift_max_abs"] = max(values[1] for _, values, _ in c.drift)
    worst["dense_adamw_drift_max_abs"] = max(own for *_, own in c.drift)
    checks = criterion.verdicts(cfg, worst, rows) + c.updates.verdicts(cfg.validate.k) + c.norms.verdicts()
    if c.reduce is not None:
        per_param = c.reduce.verdicts()
        checks.append(max(per_param, key=lambda v: (v.of_bound, v.value)))
        worst["dp_reduce_params_failed"] = sum(not v.ok for v in per_param)
    for v in checks:  # each check's worst item against its bound: at most 1 passes
        worst[f"{v.check}_of_bound"] = v.of_bound
    for name, value in worst.items():
        result.add(name, value)
    for step, values, _ in c.drift:
        for name, value in zip(DRIFT, values, strict=True):
            result.add(name, value, step=step)
    passed = all(v.ok for v in checks)
    result.add("passed", float(passed))
    if result.rank == 0:
        result.failed = [v.failure() for v in checks if not v.ok]
        result.text = criterion.table(cfg, checks, rows, passed)


def _accumulated(
    cfg: RunConfig,
    pm: ParallelModel | DDPModel,
    batches: Batches,
    ids: torch.Tensor,
    labels: torch.Tensor,
    scale: float | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The parallel model's forward and backward over this rank's slice of the global batch (ids,
    labels [K x DP x b, S]) as a training step takes it: train.accumulation = K micro-batches of b,
    each loss divided by K, the DP gradient sync as training.set_gradient_sync has it (DDP's and
    ZeRO-1's at the last micro-batch only, FSDP2's every one, Megatron's in finish_grads), then the
    gradient sums. Returns each micro-batch's logits (copies: the vocab-parallel loss's backward
    writes over them) and the mean loss. scale (the reduction check's identical inputs only): every
    rank takes DP rank 0's slice, its loss times `scale`."""
    k = cfg.train.accumulation
    if scale is None:
        mine_ids, mine_labels = batches.local_slice(ids), batches.local_slice(labels)
    else:
        rows = batches.local * k
        mine_ids, mine_labels = ids[:rows], labels[:rows]
    logits, losses = [], []
    for i in range(k):
        if k > 1:
            set_gradient_sync(pm, i == k - 1)
        with precision(cfg, batches.device):
            out, loss = pm(batches.micro(mine_ids, i), batches.micro(mine_labels, i))
            logits.append(out.detach().clone())
        out = loss / k if k > 1 else loss
        (out * scale if scale is not None and scale != 1.0 else out).backward()
        losses.append(loss.detach())
    pm.finish_grads()
    return logits, losses[0] if k == 1 else torch.stack(losses).mean()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _rel_l2(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """||a - b|| / ||scale||, in fp64."""
    return (a.double() - b.double()).norm() / scale.double().norm().clamp(min=1e-30)


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


def _param_errors(
    pm: ParallelModel | DDPModel,
    dense: torch.nn.Module,
    reference: torch.nn.Module,
    initial: dict[str, torch.Tensor],
) -> list:
    """Per parameter of this rank after the AdamW steps: max |diff| against its shard of the dense
    model's, and the relative L2 of that diff and of the dense model's against the reference's, both
    against how far the parameter moved: the dense model's shard or the reference's, the farther
    (every replica of a replicated weight counts). The dense model's alone can be nil: in bf16 a
    norm weight of 1.0 takes no step under half its ulp, and both figures were then over 1e28."""
    dense_params, ref_params = dict(dense.named_parameters()), dict(reference.named_parameters())
    stats = []
    for name, p in pm.full_parameters().items():
        want = pm.shard_like(name, dense_params[name])
        exact = pm.shard_like(name, ref_params[name])
        start = pm.shard_like(name, initial[name]).double()
        moved = max(want.double() - start, exact.double() - start, key=torch.linalg.vector_norm)
        stats.append(
            [
                (p.double() - want.double()).abs().max(),
                _rel_l2(p, want, moved),
                _rel_l2(want, exact, moved),
            ]
        )
    return stats


def _rows(pm: ParallelModel | DDPModel, grads: grad_check.WorstSteps, params: list) -> list[ParamRow]:
    """Every parameter's figures, each the worst over ranks (the gradients' are already: grad_check),
    the parameters' in one all-reduce."""
    stacked = torch.tensor([[*map(float, q)] for q in params], dtype=torch.float64)
    worst = collectives.reduce_over_world(stacked, dist.ReduceOp.MAX).cpu().tolist()
    return [
        ParamRow(
            n,
            pm.semantics(n),
            list(p.shape),
            **grads.row_fields(i),
            **dict(zip(PARAM_FIELDS, w, strict=True)),
        )
        for i, ((n, p), w) in enumerate(zip(pm.full_parameters().items(), worst, strict=True))
    ]


def _adamw(
    cfg: RunConfig,
    checked: Sequence[_Checked],
    dense: torch.nn.Module,
    reference: torch.nn.Module,
    batches: Batches,
    first: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """The AdamW steps, each parallel model's beside the dense model's and the reference's; at every
    compared step each model's drift (step, the DRIFT figures each the worst over ranks, the dense
    model's own max |logits diff| against the reference's). validate.batch=fixed trains every step
    on `first`, the forward check's global batch, and compares on it; fresh draws a batch to compare
    on, then one per step."""
    v = cfg.validate
    for c in checked:  # fused under train.fused_optimizer; a sharded level's own
        with c.own():
            c.opt = optimizer(c.cfg, c.pm, v.lr)
            zero1 = isinstance(c.pm, ZeroModel)
            c.updates = optimizer_check.WorstSteps(optimizer_check.is_fused(c.opt), zero1)
            if batches.dp > 1:
                c.reduce = reduce_check.WorstSteps(c.cfg, list(c.pm.full_parameters()))
    dense_opts = [dense_adamw(cfg.train, m, v.lr) for m in (dense, reference)]  # train.no_decay's groups
    # train.lr_scheduler over validate.steps on every side (debug.optim_fault: the sharded one's wrong)
    schedules = [scheduler(c.cfg.train, getattr(c.opt, "adamw", c.opt), v.steps, c.cfg.debug.optim_fault)
                 for c in checked] + [scheduler(cfg.train, opt, v.steps) for opt in dense_opts]  # fmt: skip
    device = batches.device
    fixed = v.batch == "fixed"
    eval_ids = first[0] if fixed else batches.next_global()[0]
    ids, labels = first
    at_dense = copy.deepcopy(reference)  # the reference at the dense model's weights, every step
    head_dim = dense.config.head_dim
    progress = StepProgress("validate", v.steps)
    for step in range(1, v.steps + 1):
        if not fixed:
            ids, labels = batches.next_global()
        for opt in (*(c.opt for c in checked), *dense_opts):
            opt.zero_grad(set_to_none=True)
        at_dense.zero_grad(set_to_none=True)
        same_weights.load_reference(at_dense, dense)
        for model in (dense, reference, at_dense):  # the references run without autocast
            with precision(cfg, device) if model is dense else contextlib.nullcontext():
                loss = model(ids, labels)[1]
            loss.backward()
        side = dense_side(cfg, dense, reference)  # train.grad_clip: the dense norms
        for c in checked:
            with c.own():
                planted.start_step(c.cfg, c.pm, step)
                with same_weights.dense_weights(c.pm, dense):  # 2. the gradients at the same weights
                    _accumulated(c.cfg, c.pm, batches, ids, labels)
                    planted.scale_grad(c.cfg, c.pm, dense, step)
                    c.grads.add(step, grad_check.step_errors(c.pm, dense, at_dense, head_dim))
                    c.norms.add(step, c.cfg, c.pm, dense, side)
                    if c.reduce is not None:  # the DP reduction on identical inputs
                        run = functools.partial(_accumulated, c.cfg, c.pm, batches, ids, labels)
                        cuda = batches.device.type == "cuda"
                        figures = reduce_check.errors(c.pm, c.opt, run, batches.dp_rank, batches.dp, cuda)
                        c.reduce.add(step, figures)
                # the optimizer on identical inputs: the dense weights, state and gradient, on copies;
                # its reference one precision above the weights AdamW steps (fp32 masters: fp64)
                up = torch.float64 if param_dtype(c.cfg) == torch.float32 else torch.float32
                rows = optimizer_check.updates(c.pm, c.opt, dense, dense_opts[0], up, side and side.coef)
                c.updates.add(step, rows)
                c.opt.zero_grad(set_to_none=True)
                _accumulated(c.cfg, c.pm, batches, ids, labels)  # 3. its own step, from its own weights
                planted.scale_grad(c.cfg, c.pm, dense, step)
                clip_sharded(c.cfg, c.pm)
                c.opt.step()
        clip_dense(side, dense, reference)
        for opt in dense_opts:
            opt.step()
        for schedule in filter(None, schedules):
            schedule.step()
        if step % v.every == 0 or step == v.steps:
            with torch.no_grad():
                with precision(cfg, device):
                    ref = batches.local_slice(dense(eval_ids)[0])
                own = _max_abs(ref, batches.local_slice(reference(eval_ids)[0]))
                for c in checked:
                    with c.own(), precision(cfg, device):
                        full = c.pm.full_logits(c.pm(batches.local_slice(eval_ids))[0])
                        worst = collectives.reduce_floats([*logits_drift(full, ref), own], dist.ReduceOp.MAX)
                    c.drift.append((step, worst[:-1], worst[-1]))
        progress.step()
