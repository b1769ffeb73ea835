"""Sharded data parallelism (parallel.dp_shard: ZeRO-1, FSDP2's ZeRO-2 and ZeRO-3, HSDP) validated
against the dense model, and each level seen failing with its reduce-scatter or its all-gather broken.

The shared torchrun jobs (tests/torchrun_checks.py's WORLD4 and WORLD2, beside test_parallel's configs)
run every config below through validate.run, on every rank: 4 ranks for DP 2 x TP 2 (each TP mode of
both engines under some level, in fp32 and mixed precision, with recompute and overlap) and HSDP's
DP 4; 2 ranks for DP 2 x TP 1 (mode=ddp) at every level. The whole grid, every level x every mode, in
fp32 (and again with `precision=mixed dtype=bfloat16`):

    tpbench sweep kind=validate dp=2 dp_shard=optimizer,grads,full \
        mode=tp,tp_sp,tp_sp_linear,tp_vp,tp_sp_vp,ddp
    tpbench sweep kind=validate dp=2 dp_shard=grads,full \
        mode=dtensor_tp,dtensor_tp_sp,dtensor_tp_vp,dtensor_tp_sp_vp

(docs/results/sharded_dp.md: the mixed grid, each run's worst check against its bound, and the
mixed cases below, each level broken.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from beside import beside
from test_cli import nothing_written, workdir  # noqa: F401 (a fixture)
from torchrun_checks import BUCKETS, WORLD2, WORLD4, Crashed, per_config, run_config, same_on_every_rank
from typer.testing import CliRunner

from tpbench.cli import app

# train.compile=false: what auto resolves to for a CPU run (run_config does not resolve auto)
TINY = ["model.flash_attn=false", "train.compile=false", "validate.steps=3", "validate.every=3"]
MIXED = ["train.precision=mixed", "train.dtype=bfloat16"]
MODES = {  # conf/mode/, at T 2
    "tp": ["parallel.tp=2"],
    "tp_sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp_sp_linear": ["parallel.tp=2", "parallel.sp=true", "parallel.sp_gather=linear"],
    "tp_vp": ["parallel.tp=2", "parallel.vp=true"],
    "tp_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
    "dtensor_tp_sp_vp": ["parallel.engine=dtensor", "parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
}
DP2_TP2 = {  # each level under a TP mode, fp32 and mixed, with overlap and recompute, both engines
    # DTensor's own DP sum (dp_shard none), mixed, one AdamW step, and that sum in bf16
    "dtensor_mixed": [
        "parallel.engine=dtensor",
        "parallel.tp=2",
        *MIXED,
        "validate.steps=1",
        "validate.every=1",
    ],
    "low_reduce_dtensor_mixed": [
        "parallel.engine=dtensor",
        "parallel.tp=2",
        "debug.low_precision_reduce=true",
        *MIXED,
        "validate.steps=1",
        "validate.every=1",
    ],  # fmt: skip
    "optimizer_tp_sp_vp_mixed": [*MODES["tp_sp_vp"], "parallel.dp_shard=optimizer", BUCKETS, *MIXED],
    "optimizer_tp_vp_overlap_recompute": [
        *MODES["tp_vp"],
        "parallel.dp_shard=optimizer",
        BUCKETS,
        "parallel.overlap=true",
        "train.recompute=selective",
    ],
    "grads_tp_sp_linear": [*MODES["tp_sp_linear"], "parallel.dp_shard=grads"],
    "full_tp_sp_vp": [*MODES["tp_sp_vp"], "parallel.dp_shard=full"],
    "full_dtensor_tp_sp_vp": [*MODES["dtensor_tp_sp_vp"], "parallel.dp_shard=full"],
    "hsdp_full_dp4": ["parallel.tp=1", "parallel.dp_shard=full", "parallel.dp_replicate=2"],
    # per-op recompute (torchtitan's) under ZeRO-1 and under FSDP2 in mixed precision
    "optimizer_tp_sp_op": [*MODES["tp_sp"], "parallel.dp_shard=optimizer", "train.recompute=op"],
    "full_tp_sp_vp_mixed_op": [*MODES["tp_sp_vp"], "parallel.dp_shard=full", *MIXED, "train.recompute=op"],
    # and on DTensor's engine: op under FSDP2, full under its own DP sum in mixed precision
    "full_dtensor_tp_sp_vp_op": [*MODES["dtensor_tp_sp_vp"], "parallel.dp_shard=full", "train.recompute=op"],
    "dtensor_mixed_full": [
        "parallel.engine=dtensor",
        "parallel.tp=2",
        *MIXED,
        "train.recompute=full",
        "validate.steps=1",
        "validate.every=1",
    ],
    "broken_optimizer_all_gather": [
        *MODES["tp_sp"],
        "parallel.dp_shard=optimizer",
        BUCKETS,
        "debug.shard_fault=no_all_gather",
    ],
}
DDP = ["parallel.engine=ddp", "parallel.tp=1"]
ONE_STEP = ["validate.steps=1", "validate.every=1"]
NO_GATHER, NO_RS = "debug.shard_fault=no_all_gather", "debug.shard_fault=no_reduce_scatter"
LOW = "debug.low_precision_reduce=true"
EARLY = "debug.shard_fault=early_reduce_scatter"
DP2_TP1 = {  # mode=ddp
    "optimizer_ddp": [*DDP, "parallel.dp_shard=optimizer", BUCKETS],
    "grads_ddp_mixed": [*DDP, "parallel.dp_shard=grads", *MIXED],
    "full_ddp_recompute": [*DDP, "parallel.dp_shard=full", "train.recompute=full"],
    "broken_optimizer_reduce_scatter": [
        *DDP,
        "parallel.dp_shard=optimizer",
        BUCKETS,
        "debug.shard_fault=no_reduce_scatter",
    ],
    "broken_grads_all_gather": [*DDP, "parallel.dp_shard=grads", "debug.shard_fault=no_all_gather"],
    # ZeRO-1's buckets: each reduce-scattered at its first gradient, not its last
    "broken_optimizer_early_reduce_scatter": [*DDP, "parallel.dp_shard=optimizer", BUCKETS, EARLY],
    "broken_full_reduce_scatter": [*DDP, "parallel.dp_shard=full", "debug.shard_fault=no_reduce_scatter"],
    # mixed precision (bf16 compute, fp32 masters and reduction), every level, the cheapest shape: DP
    # 2 x TP 1 (native bf16 GEMMs: launch.bf16_gemm=fp32_accumulate costs more than it saves at this
    # size, docs/results/validation.md); each level broken in the collective its fp32 case above keeps,
    # at one AdamW step, which every broken collective fails already (ZeRO-1's gather after the step
    # by 2.3x its bound there: given TINY's 3 steps, as its stale weights feed the next ones)
    "full_ddp_mixed": [*DDP, "parallel.dp_shard=full", *MIXED],
    "broken_none_all_reduce_mixed": [*DDP, "debug.ddp_fault=no_divide", *MIXED, *ONE_STEP],
    "broken_optimizer_all_gather_mixed": [*DDP, "parallel.dp_shard=optimizer", BUCKETS, NO_GATHER, *MIXED],
    "broken_grads_reduce_scatter_mixed": [*DDP, "parallel.dp_shard=grads", NO_RS, *MIXED, *ONE_STEP],
    "broken_full_all_gather_mixed": [*DDP, "parallel.dp_shard=full", NO_GATHER, *MIXED, *ONE_STEP],
    # debug.low_precision_reduce: the DP gradient reduction in bf16 where mixed precision promises fp32
    # (DDP's comm hook, ZeRO-1's reduce-scatter, FSDP2 with no reduce_dtype), one AdamW step
    **{
        f"low_reduce_{level}_mixed": [*DDP, f"parallel.dp_shard={level}", BUCKETS, LOW, *MIXED, *ONE_STEP]
        for level in ("none", "optimizer", "full")
    },
    # tpbench's engine's own DP sum (one coalesced all-reduce; parallel.overlap's buckets), mixed, one
    # AdamW step, each also with that sum in bf16 (debug.low_precision_reduce: seen accepted and inert
    # there until 2026-12-07, a planted bug that planted nothing)
    **{
        f"{low}megatron{overlap}_mixed": [
            "parallel.tp=1",
            *(["parallel.overlap=true"] if overlap else []),
            *([LOW] if low else []),
            *MIXED,
            *ONE_STEP,
        ]  # fmt: skip
        for low in ("", "low_reduce_")
        for overlap in ("", "_overlap")
    },
}

# --- the torchrun jobs: the shared world-4 and world-2 ones (one launch each for several files) ------

WORLD4.add("validate", "sharded", {k: [*TINY, f"parallel.dp={4 if k.startswith('hsdp') else 2}", *v]
                                   for k, v in DP2_TP2.items()})  # fmt: skip
WORLD2.add("validate", "sharded", {k: [*TINY, "parallel.dp=2", *v] for k, v in DP2_TP1.items()})


def _rank0(ranks: list[dict]) -> dict:
    """Rank 0's results per config, once every rank reported the same verdict figures and collectives
    (the failed checks' lines are rank 0's alone: what the database records)."""
    out = {}
    for name, per_rank in per_config(ranks).items():
        if not isinstance(per_rank[0], Crashed):  # a crashed config fails the tests that read it only
            same_on_every_rank([{"metrics": r["metrics"], "comm": r["comm"]} for r in per_rank])
        out[name] = per_rank[0]
    return out


@beside
def dp2_tp2(folder: Path) -> dict:
    return _rank0(WORLD4.part(folder, "validate", "sharded"))


@beside
def dp2_tp1(folder: Path) -> dict:
    return _rank0(WORLD2.part(folder, "validate", "sharded"))


# --- the assertions ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in DP2_TP2 if not n.startswith(("broken", "low_reduce"))])
def test_each_level_matches_dense_at_dp2_tp2(dp2_tp2, name):
    r = dp2_tp2[name]
    assert r["failed"] == [] and r["metrics"]["passed"] == 1.0


@pytest.mark.parametrize("name", [n for n in DP2_TP1 if not n.startswith(("broken", "low_reduce"))])
def test_each_level_matches_dense_at_dp2_with_mode_ddp(dp2_tp1, name):
    r = dp2_tp1[name]
    assert r["failed"] == [] and r["metrics"]["passed"] == 1.0


@pytest.mark.parametrize("name", [*DP2_TP2, *DP2_TP1])
def test_the_sign_rule_writes_the_gradients_where_each_level_steps_them(dp2_tp2, dp2_tp1, name):
    """write_gradients (validate's sign rule) into ZeRO-1's shard, FSDP2's sharded DTensors, HSDP's:
    every gradient doubled, read back doubled (then restored), on every rank."""
    r = (dp2_tp2 | dp2_tp1)[name]
    assert r["write_gradients_error"] == 0.0


# What each planted fault breaks, reasoned from where its collective sits in a step. Validation's
# checks (tpbench.experiments.criterion): the first forward (logits, loss), the gradients at every step
# at the dense model's weights (per parameter and per row), the DP reduction on identical inputs
# (tpbench.experiments.reduce_check: every DP rank the same micro-batches, rank 0's loss x 2), the
# optimizer on identical inputs (tpbench.experiments.optimizer_check: the update, and ZeRO-1's gathered
# weights against its masters), and the free-running AdamW steps (parameters, logits drift: a verdict
# in fp32 only)
FORWARD = {"fwd_logits_max_abs", "loss_abs_diff"}
GRADIENTS = {"grad_rel_l2", "grad_row_rel_l2"}
REDUCE = {"dp_reduce"}
FREE = {"adamw_param_rel_l2", "adamw_drift_max_abs"}
SHARD_BREAKS = {  # fault -> (the checks that fail, every other passing; whether every gradient fails)
    # a reduce-scatter left out: each rank steps its own gradients, never averaged, so every gradient
    # is wrong (each element lies in some rank's shard: that rank's own), and so are the free-running
    # steps taken from them; on identical inputs rank 0's doubled gradient is never averaged with the
    # others' (the reduction check); the first forward, before any step, is right
    "broken_optimizer_reduce_scatter": (GRADIENTS | REDUCE | FREE, True),
    "broken_full_reduce_scatter": (GRADIENTS | REDUCE | FREE, True),
    # FSDP2's all-gather left out: half of every weight is zeros in every forward, the first one too;
    # every gradient comes out 0 (measured), whose reduction on identical inputs is exact
    "broken_grads_all_gather": (FORWARD | GRADIENTS | FREE, True),
    # ZeRO-1's all-gather left out: it runs after the step, so it breaks parameters, not gradients. The
    # gradient check puts the dense weights where the forward reads them (the param buffer): every
    # gradient right. The optimizer check sees the stale half (the gathered weights against the
    # masters), and the free-running steps in their parameters and drift
    "broken_optimizer_all_gather": ({"optimizer_gather"} | FREE, False),
    # in mixed precision the free-running checks give no verdict: the gradients show the faults, and
    # the forward a gather before it; DDP's sum left undivided doubles every gradient, on identical
    # inputs too (R2 / R1 stays 3 / 2: the reduction check passes it)
    "broken_none_all_reduce_mixed": (GRADIENTS, True),
    "broken_grads_reduce_scatter_mixed": (GRADIENTS | REDUCE, True),
    "broken_full_all_gather_mixed": (FORWARD | GRADIENTS, True),
    # ZeRO-1's all-gather left out in mixed precision: only the optimizer check sees it
    "broken_optimizer_all_gather_mixed": ({"optimizer_gather"}, False),
}
K, TOL_GRAD = 4.0, 1e-5  # the criterion's multiple and the gradient floor (validate.k, validate.tol_grad_rel)


@pytest.mark.parametrize("name", SHARD_BREAKS)
def test_a_planted_shard_fault_fails_exactly_the_checks_and_gradients_it_breaks(dp2_tp2, dp2_tp1, name):
    """Each fault fails the checks SHARD_BREAKS derives for it and passes every other; the gradient
    check fails every parameter past its own bound (K x the dense model's error against the reference
    + the floor), or none. Both jobs as fixtures, not looked up inside the test: the quick tier
    (conftest.py) leaves out what waits on a job by its fixtures."""
    r = (dp2_tp2 | dp2_tp1)[name]
    checks, every_gradient = SHARD_BREAKS[name]
    assert r["metrics"]["passed"] == 0.0
    assert {line.split()[0] for line in r["failed"]} == checks, r["failed"]
    failing = {n for n, (error, reference) in r["params"].items() if error > K * reference + TOL_GRAD}
    assert failing == (set(r["params"]) if every_gradient else set())


def test_a_bucket_reduce_scattered_before_its_last_gradient_fails_all_but_its_first(dp2_tp1):
    """debug.shard_fault=early_reduce_scatter: each of ZeRO-1's buckets reduce-scattered (and waited)
    when its first gradient is in: that parameter is averaged, the bucket's later ones keep this
    rank's own gradient. The gradients fail (every parameter but one a bucket: the first each bucket
    got, and the late bucket's, the tied embedding, reduce-scattered after backward), so do the DP
    reduction on identical inputs and the free-running steps; the first forward, before any step,
    passes."""
    from tpbench.predict.theory.sharding import level_dims
    from tpbench.predict.theory.shards import zero_buckets

    r = dp2_tp1["broken_optimizer_early_reduce_scatter"]
    assert r["metrics"]["passed"] == 0.0
    assert {line.split()[0] for line in r["failed"]} == GRADIENTS | REDUCE | FREE, r["failed"]
    failing = {n for n, (error, reference) in r["params"].items() if error > K * reference + TOL_GRAD}
    buckets = zero_buckets(level_dims(run_config(DP2_TP1["broken_optimizer_early_reduce_scatter"])), 2)
    assert len(buckets) > 2 and buckets[-1][1]  # several, the late one last
    assert len(set(r["params"]) - failing) == len(buckets)
    assert "model.embed_tokens.weight" not in failing


LOW_REDUCE = [  # each level's low-precision reduction, the same level reducing in fp32 (a fault
    # elsewhere in it leaves the DP gradients' collective as it is), the collective
    ("low_reduce_none_mixed", "broken_none_all_reduce_mixed", "all_reduce"),
    ("low_reduce_optimizer_mixed", "broken_optimizer_all_gather_mixed", "reduce_scatter"),
    ("low_reduce_full_mixed", "full_ddp_mixed", "reduce_scatter"),
    ("low_reduce_megatron_mixed", "megatron_mixed", "all_reduce"),
    ("low_reduce_megatron_overlap_mixed", "megatron_overlap_mixed", "all_reduce"),
    ("low_reduce_dtensor_mixed", "dtensor_mixed", "all_reduce"),
]


@pytest.mark.parametrize("name, fp32, op", LOW_REDUCE, ids=[n for n, *_ in LOW_REDUCE])
def test_the_low_precision_reduce_sends_the_dp_gradients_in_bf16(dp2_tp2, dp2_tp1, name, fp32, op):
    """debug.low_precision_reduce acts at each level and engine: the DP gradients' collective moves
    bf16, half the bytes of the same config's fp32 reduction, as many times."""
    runs = dp2_tp2 | dp2_tp1
    low, full = _comm(runs[name])[op, "dp_grads"], _comm(runs[fp32])[op, "dp_grads"]
    assert low[0] == full[0] and 2 * low[1] == full[1]


@pytest.mark.parametrize("name", [n for n, *_ in LOW_REDUCE])
def test_the_low_precision_reduce_fails_validation_naming_every_gradient(dp2_tp2, dp2_tp1, name):
    """Every gradient is reduced in bf16: on identical inputs (every DP rank rank 0's micro-batch, rank
    0's loss x 2) each parameter's reduced gradient is off the exact 3/2 of the first pass's by bf16's
    rounding, about 2^-10 relative, past the reduction check's bound (16 x fp32's unit roundoff,
    9.5e-7) by over 1,000 times; the check alone fails, naming its worst parameter. The gradient check
    does not see it: a 2^-9 error under bf16 compute's own 0.4-2.6% (every gradient within its bound)."""
    r = (dp2_tp2 | dp2_tp1)[name]
    assert r["metrics"]["passed"] == 0.0
    assert r["metrics"]["dp_reduce_params_failed"] == len(r["params"])
    assert r["metrics"]["dp_reduce_of_bound"] > 1000
    ((check, param, *_),) = [f.split() for f in r["failed"]]
    assert check == "dp_reduce" and param in r["params"]
    assert {n for n, (error, reference) in r["params"].items() if error > K * reference + TOL_GRAD} == set()


@pytest.mark.parametrize("name", [n for n in (*DP2_TP2, *DP2_TP1) if not n.startswith(("broken", "low_"))])
def test_the_reduction_and_the_optimizer_on_identical_inputs_are_exact_where_correct(dp2_tp2, dp2_tp1, name):
    """A correct level's DP reduction of identical inputs is exact here (DP 2: 2 g + g and its halving
    need no rounding in fp32 for these gradients; DP 4: within the bound) and its AdamW steps the
    dense update bit for bit (per tensor on a CPU; fused AdamW is another kernel, not run here), and
    ZeRO-1's gathered weights are its masters in bf16 or fp32, bit for bit."""
    m = (dp2_tp2 | dp2_tp1)[name]["metrics"]
    assert m["dp_reduce_params_failed"] == 0 and m["dp_reduce_of_bound"] <= 1
    assert m["optimizer_update_of_bound"] == 0.0
    assert m.get("optimizer_gather_of_bound", 0.0) == 0.0
    assert ("optimizer_gather_of_bound" in m) == ("parallel.dp_shard=optimizer" in (DP2_TP2 | DP2_TP1)[name])


def _comm(r: dict) -> dict[tuple[str, str], tuple[int, int]]:
    return {(op, purpose): (count, size) for op, purpose, count, size in r["comm"]}


def test_the_dp_collectives_are_counted_by_purpose(dp2_tp1, dp2_tp2):
    """ZeRO-1 reduce-scatters the gradients bucket by bucket (its all-gathers are in the optimizer
    step, after the counted backward); FSDP2 all-gathers each unit's weights once (grads) or twice
    (full: again for backward) and reduce-scatters its gradients, per unit: 2 blocks and the root;
    HSDP all-reduces the reduce-scattered gradients across its replicas as well. None all-reduces
    like DDP."""
    from tpbench.predict.theory.sharding import level_dims
    from tpbench.predict.theory.shards import zero_buckets

    zero1 = _comm(dp2_tp1["optimizer_ddp"])
    buckets = len(zero_buckets(level_dims(run_config(DP2_TP1["optimizer_ddp"])), 2))
    assert zero1[("reduce_scatter", "dp_grads")][0] == buckets > 2 and ("all_reduce", "dp_grads") not in zero1
    grads = _comm(dp2_tp2["grads_tp_sp_linear"])
    assert grads[("all_gather", "dp_params")][0] == 3 and grads[("reduce_scatter", "dp_grads")][0] == 3
    full = _comm(dp2_tp2["full_tp_sp_vp"])
    assert full[("all_gather", "dp_params")][0] == 6 and full[("reduce_scatter", "dp_grads")][0] == 3
    # in fp32 a unit's gather moves the bytes its reduce-scatter moves: ZeRO-3 gathers twice
    assert full[("all_gather", "dp_params")][1] == 2 * full[("reduce_scatter", "dp_grads")][1]
    assert grads[("all_gather", "dp_params")][1] == grads[("reduce_scatter", "dp_grads")][1]
    hsdp = _comm(dp2_tp2["hsdp_full_dp4"])
    assert hsdp[("all_reduce", "dp_grads")][0] == 3


REFUSED = {  # before launch: one line, exit 2
    "nothing to shard over": (
        ["dp=1", "dp_shard=full"],
        "parallel.dp_shard=full with parallel.dp=1 (nothing",
    ),
    "replicas not dividing dp": (["dp=4", "dp_shard=full", "dp_replicate=3"], "parallel.dp_replicate=3 with"),
    "replicas of ZeRO-1": (["dp=4", "dp_shard=optimizer", "dp_replicate=2"], "HSDP replicates FSDP2's"),
    "a fault without a level": (
        ["dp=2", "debug.shard_fault=no_all_gather"],
        "debug.shard_fault=no_all_gather:",
    ),
    "an unknown fault": (["dp=2", "dp_shard=full", "debug.shard_fault=drop"], "debug.shard_fault='drop': "),
    "a bucket fault without ZeRO-1": (
        ["dp=2", "dp_shard=full", "debug.shard_fault=early_reduce_scatter"],
        "debug.shard_fault=early_reduce_scatter with parallel.dp_shard=full: breaks ZeRO-1's buckets",
    ),
    "a bucket size below 0": (
        ["dp=2", "dp_shard=optimizer", "parallel.zero_bucket_elements=-1"],
        "parallel.zero_bucket_elements=-1: accepted are integers >= 0",
    ),
    "a DDP fault with no DDP": (
        ["mode=ddp", "dp_shard=optimizer", "debug.ddp_fault=no_divide"],
        "parallel.dp_shard=optimizer with debug.ddp_fault=no_divide",
    ),
    "ZeRO-1 on dtensor": (["mode=dtensor_tp", "dp=2", "dp_shard=optimizer"], "with parallel.engine=dtensor"),
}


@pytest.mark.parametrize("overrides, says", REFUSED.values(), ids=REFUSED.keys())
def test_a_level_that_cannot_run_is_refused_in_one_line(workdir, overrides, says):  # noqa: F811
    done = CliRunner().invoke(app, ["run", "kind=validate", *overrides])
    assert done.exit_code == 2, done.output
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    assert nothing_written(workdir)


def test_a_memory_run_the_model_is_not_checked_for_is_refused(workdir, monkeypatch):  # noqa: F811
    """Every level is checked, mixed precision and accumulation too; a reason planted for one is a
    refusal before anything is written."""
    from tpbench.predict import checked
    from tpbench.run import compose

    overrides = ["kind=memory", "dp=2", "dp_shard=grads", "precision=mixed", "dtype=bfloat16"]
    assert len(compose.expand([*overrides, "accumulation=2"], launching=False)) == 1
    monkeypatch.setattr(checked, "unchecked", lambda cfg: "planted" if cfg.train.accumulation > 1 else None)
    done = CliRunner().invoke(app, ["run", *overrides, "accumulation=2"])
    assert done.exit_code == 2, done.output
    assert done.stderr.startswith("kind=memory: the memory model is not checked for planted")
    assert len(done.stderr.splitlines()) == 1
    assert nothing_written(workdir)


@pytest.mark.parametrize("mixed", [False, True], ids=["pure", "mixed"])
def test_zero1_keeps_one_copy_of_the_weights_in_pure_precision(mixed):
    """Pure precision: AdamW's master shard is the parameter buffer's own slice (a view of it, no
    second copy), stepped in place; mixed: its own fp32 copy. One process (no DP group: the shard is
    the whole buffer), the step's new weights seen in the model's parameters either way."""
    import torch
    from torch import nn

    from tpbench.parallel.zero import DistributedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    params = dict(model.named_parameters())
    master = torch.float32
    param = torch.bfloat16 if mixed else torch.float32
    zopt = DistributedOptimizer(params, None, lambda ps: torch.optim.AdamW(ps, lr=0.1), param, master)
    for piece in zopt.masters:
        shares = piece.untyped_storage().data_ptr() == zopt.param_buffer.untyped_storage().data_ptr()
        assert shares != mixed
    before = {n: p.detach().float().clone() for n, p in params.items()}
    model(torch.randn(5, 4, dtype=param)).float().square().sum().backward()
    zopt.reduce_scatter()
    zopt.step()
    masters = zopt.full_masters()
    for name, p in params.items():
        assert not torch.equal(p.detach().float(), before[name])
        assert torch.equal(p.detach(), masters[name].to(param))


def test_zero1_waits_each_buckets_gather_where_the_next_forward_first_needs_it():
    """After AdamW every bucket's all-gather is in flight; the next forward waits for each one just
    before the first module that uses it (the embedding's bucket before the embedding, a block's
    when the block starts), not all at the forward's start: Megatron's overlap_param_gather. One
    emulated rank of DP 2 (torch's fake backend), each bucket waited once."""
    import torch.distributed as dist

    from tpbench.experiments.training import Trainer
    from tpbench.parallel import emulation

    cfg = run_config(
        ["parallel.tp=1", "parallel.dp=2", "parallel.dp_shard=optimizer", BUCKETS, "train.compile=false"]
    )
    emulation.init_process_group(cfg)
    try:
        trainer = Trainer(cfg)
        opt, model = trainer.optimizer, trainer.module
        trainer.step()
        assert len(opt.buckets) > 2 and all(p is not None for p in opt.gather_pending)
        seen, wait = [], opt.wait_gather

        def recorded(i: int) -> None:
            if opt.gather_pending[i] is not None:
                seen.append(("wait", i))
            wait(i)

        opt.wait_gather = recorded
        units = {"model.embed_tokens": model.model.embed_tokens}
        units |= {f"model.layers.{i}": block for i, block in enumerate(model.model.layers)}
        for name, unit in units.items():
            unit.register_forward_pre_hook(lambda m, a, name=name: seen.append(("enter", name)))
        ids, labels = trainer.batches.next_local()
        with torch.no_grad():
            trainer.model(ids, labels)
        assert sorted(i for kind, i in seen if kind == "wait") == list(range(len(opt.buckets)))
        assert all(p is None for p in opt.gather_pending)
        for name in units:  # each unit's buckets waited by the time it starts, after the unit before
            at = seen.index(("enter", name))
            mine = {opt.bucket_of[n] for n in opt.params if n.startswith(name + ".")}
            assert mine <= {i for kind, i in seen[:at] if kind == "wait"}, (name, seen)
        first_block = seen.index(("enter", "model.layers.0"))
        assert any(kind == "wait" for kind, _ in seen[first_block:])  # not all waited up front
    finally:
        dist.destroy_process_group()


def test_zero1_launches_each_buckets_reduce_scatter_in_backward_the_late_one_after():
    """Once backward returns every bucket but the late one has its reduce-scatter launched (from the
    gradients' hooks, each as its last gradient came), the late one (the tied embedding: after the TP
    sums) only at finish_grads, which waits for all; a backward that does not sync (accumulation's
    earlier micro-batches) launches none. One emulated rank of DP 2 (fake backend)."""
    import torch.distributed as dist

    from tpbench.experiments.setup import precision
    from tpbench.experiments.training import Trainer
    from tpbench.parallel import emulation

    cfg = run_config(
        ["parallel.tp=1", "parallel.dp=2", "parallel.dp_shard=optimizer", BUCKETS, "train.compile=false"]
    )
    emulation.init_process_group(cfg)
    try:
        trainer = Trainer(cfg)
        opt, zero = trainer.optimizer, trainer.model
        ids, labels = trainer.batches.next_local()
        for sync in (False, True):
            opt.zero_grad()
            zero.set_gradient_sync(sync)
            with precision(cfg, trainer.ctx.device):
                loss = zero(ids, labels)[1]
            loss.backward()
            launched = [p is not None for p in opt.reduce_pending]
            assert launched == [sync and not b.late for b in opt.buckets], (sync, launched)
        assert len(opt.buckets) > 2 and opt.buckets[-1].late
        zero.finish_grads()
        assert all(p is None for p in opt.reduce_pending)
    finally:
        dist.destroy_process_group()
