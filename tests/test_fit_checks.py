"""`tpbench fit` checked against what is known: torchtitan's two published runs fit where they ran, the
accumulation of a global batch, and the factors a wrong model would get wrong, each planted here to see
the check fail (moments in bf16 under mixed precision; the margin ignored). All in-process: fit runs
nothing. docs/results/fit.md has the commands and figures."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.predict import theory
from tpbench.predict.theory import weights
from tpbench.run import compose
from tpbench.sizing import fit as fitting
from tpbench.sizing import layouts

GiB = 2**30
runner = CliRunner()
# torchtitan's H100s have 96 GB of HBM2e, a part the table has no row for: its memory as the driver
# would report it, assumed in the ratio of the 80 GB H100's (81559 MiB of 81920: 99.56%)
H100_96GB_GIB = 96 * 81559 / 81920


def search(line: str, **kw) -> fitting.Fit:
    request = fitting.parse(line.split())
    (base,) = compose.expand(request.overrides, single=True, launching=False)
    return fitting.solve(request, base, **kw)


def row_of(fit: fitting.Fit, **want) -> layouts.Row:
    (row,) = [r for r in fit.rows if all(getattr(r, k) == v for k, v in want.items())]
    return row


# --- torchtitan's published runs (docs/results/fit.md) ---------------------------------------------


def test_torchtitan_llama3_8b_fsdp_8_local_batch_2_fits_at_full_recompute():
    # FSDP over 8 GPUs, local batch 2, seq 8192, bf16 mixed; torchtitan's per-op selective AC keeps
    # less than tpbench's selective (everything but the SwiGLU product) and more than full
    line = (  # torchtitan's AdamW is fused (its optimizer's implementation = "fused")
        "model=llama3_8b seq=8192 gpu=H100 global_batch=16 tp=1 dp_shard=full micro_batch=2 "
        "train.fused_optimizer=true"
    )
    fit = search(line, reported_bytes=int(H100_96GB_GIB * GiB))
    full = row_of(fit, recompute="full")
    assert full.fits and (full.gpus, full.dp, full.micro_batch, full.accumulation) == (8, 8, 2, 1)
    assert fit.base.train.precision == "mixed" and full.dp_shard == "full"
    # tpbench's selective runs but is tight by the predicted reserve: 87.47 GiB live, 93.79 GiB with
    # the cuBLAS workspaces, FSDP2's stream pools (2.61 GiB copy-in, 3.80 reduce-scatter) and NCCL,
    # 1.29 GiB of headroom under the 4.75 GiB margin (it fit by the allocated bytes alone, 7.8 GB over
    # the margin, since model.fused_ops, f09ed63); with MiniMind's ops it keeps too much, as before
    selective = row_of(fit, recompute="selective")
    assert selective.tight and not selective.fits
    unfused = search(f"{line} model.fused_ops=false", reported_bytes=int(H100_96GB_GIB * GiB))
    assert not row_of(unfused, recompute="selective").runs


def test_torchtitan_llama3_70b_fsdp_32_tp_8_local_batch_16_full_recompute_fits():
    line = (
        "model=llama3_70b seq=8192 gpu=H100 nodes=32 global_batch=512 tp=8 sp=true vp=true "
        "dp_shard=full recompute=full micro_batch=16 train.fused_optimizer=true"
    )
    fit = search(line, reported_bytes=int(H100_96GB_GIB * GiB))
    row = row_of(fit, dp_replicate=1)
    assert row.fits and (row.gpus, row.dp, row.micro_batch, row.accumulation) == (256, 32, 16, 1)
    assert fit.base.train.precision == "mixed" and row.headroom_bytes >= fit.memory.margin_bytes


# --- accumulation ---------------------------------------------------------------------------------


def test_accumulation_repeats_the_micro_step_and_syncs_dp_once():
    base = "model=qwen3_0_6b seq=2048 gpu=H100 tp=2 sp=true vp=true recompute=none micro_batch=4"
    one, four = (search(f"{base} global_batch={b} dp_shard=none") for b in (16, 64))
    a, b = one.rows[0], four.rows[0]
    assert (a.dp, a.accumulation, b.accumulation) == (4, 1, 4)
    # DDP's no_sync: the earlier micro-steps' gradients autograd's own beside its buckets, whose views
    # they become at the last one's sync only: the step's peak is over one micro-step's
    assert b.peak_bytes > a.peak_bytes
    timed = fitting.search_module.steptime.predict_time(one.config(a), fitting.search_module.rates(one))
    sync = sum(timed.comm_exposed.get(p, 0.0) for p in fitting.search_module.DP_SYNC)
    assert fitting.search_module.DP_SYNC == ("dp_grads", "dp_params")  # the time model's purposes
    micro = timed.compute_s + timed.comm_s - sync
    assert sync > 0 and b.step_s == pytest.approx(4 * micro + sync + timed.optimizer_s)
    assert b.tokens_per_step == 4 * a.tokens_per_step == 64 * 2048
    fsdp = search(f"{base} global_batch=64 dp_shard=full").rows[0]  # FSDP syncs every micro-step
    timed = fitting.search_module.steptime.predict_time(four.config(fsdp), fitting.search_module.rates(four))
    assert fsdp.step_s == pytest.approx(4 * (timed.compute_s + timed.comm_s) + timed.optimizer_s)


# --- planted wrong factors ------------------------------------------------------------------------


# Qwen3-0.6B's parameters on one rank, counted by hand from its config (H 1024, L 28, 16 query heads
# and 8 KV heads of 128, I 3072, V 151,936, tied): a block holds q 1024 x 2048, k and v 1024 x 1024
# each, o 2048 x 1024, gate, up and down 1024 x 3072 each (15,728,640, halved at T 2: 7,864,320),
# beside its q and k norms (128 each) and two norms (1024 each), replicated: 2,304; 28 blocks, the
# final norm (1024) and the embedding, 151,936 x 1024 = 155,582,464, halved under VP
QWEN3_0_6B_PER_RANK = {  # (tp, vp) -> elements
    (1, False): 28 * (15_728_640 + 2_304) + 1024 + 155_582_464,  # 596,049,920
    (2, False): 28 * (7_864_320 + 2_304) + 1024 + 155_582_464,  # 375,848,960
    (2, True): 28 * (7_864_320 + 2_304) + 1024 + 77_791_232,  # 298,057,728
}
QWEN3_0_6B_TENSORS = 28 * 11 + 2  # per block 7 matrices and 4 norms; the embedding and final norm


def moments_not_fp32(fit: fitting.Fit) -> list[str]:
    """The DDP rows whose AdamW state is not fp32 moments under mixed precision: 8 bytes a parameter of
    the rank (+ a 4-byte step per tensor, fused AdamW), the parameters counted by hand above."""
    wrong = []
    for row in fit.rows:
        if row.reason or row.dp_shard != "none":
            continue
        cfg = fit.config(row)
        elements = QWEN3_0_6B_PER_RANK[(cfg.parallel.tp, cfg.parallel.vp)]
        if theory.predict(cfg).peak.optimizer != 8 * elements + 4 * QWEN3_0_6B_TENSORS:
            wrong.append(row.label())
    return wrong


def margin_broken(fit: fitting.Fit) -> list[str]:
    """The rows called a fit that leave less than the margin free, and the tight rows that do not."""
    margin = fit.memory.margin_bytes
    assert margin == int(fit.memory.margin * fit.memory.usable_bytes) > 0
    return [r.label() for r in fit.fitting if r.headroom_bytes < margin] + [
        r.label() for r in fit.tight if not 0 <= r.headroom_bytes < margin
    ]


PLANTED = "model=qwen3_0_6b seq=4096 gpu=L4 gpus_per_node=2 dp_shard=none train.fused_optimizer=true"


def ddp_rows(fit: fitting.Fit) -> list[str]:
    return [r.label() for r in fit.rows if not r.reason and r.dp_shard == "none"]


def test_moments_in_bf16_under_mixed_precision_are_caught(monkeypatch):
    fit = search(PLANTED, max_micro_batch=8)
    assert fit.base.train.precision == "mixed" and ddp_rows(fit) and moments_not_fp32(fit) == []
    elements = weights.param_bytes  # planted: the moments in bf16, half the master weights' bytes
    monkeypatch.setattr(weights, "optimizer_bytes", lambda d: elements(d) + 4 * len(weights.params(d)))
    planted = search(PLANTED, max_micro_batch=8)
    assert ddp_rows(planted) and moments_not_fp32(planted) == ddp_rows(planted)  # every DDP row, named


def test_the_margin_ignored_is_caught(monkeypatch):
    assert margin_broken(search(PLANTED, max_micro_batch=64)) == []
    monkeypatch.setattr(layouts.Row, "fits", property(lambda r: r.runs))  # planted: margin ignored
    fit = search(PLANTED, max_micro_batch=64, margin=0.3)
    under = [r.label() for r in fit.fitting if r.headroom_bytes < fit.memory.margin_bytes]
    assert under and margin_broken(fit) == under  # the rows that now "fit" inside the margin, named


def test_a_405b_search_on_64_nodes_takes_seconds():
    # T 8 with SP and VP: 32 of the whole search's 488 layouts (1.6 s of CPU: docs/results/fit.md)
    line = "model=llama3_405b seq=8192 gpu=H100 nodes=64 precision=pure tp=8 sp=true vp=true"
    request = fitting.parse(line.split())
    (base,) = compose.expand(request.overrides, single=True, launching=False)
    start = time.process_time()
    fit = fitting.solve(request, base)
    assert time.process_time() - start < 2.0  # ~0.3 s
    assert len(fit.rows) == 32 and fit.fitting[0].dp_shard == "full"


# --- between nodes --------------------------------------------------------------------------------


def test_dp_between_nodes_runs_at_the_networks_rate():
    line = (
        "model=qwen3_0_6b seq=2048 gpu=H100 gpus_per_node=2 tp=2 sp=true vp=true recompute=none micro_batch=4"
    )
    one, slow, fast = (
        search(f"{line} nodes={n} dp_shard=none", network_gbps=g) for n, g in ((1, 400), (2, 400), (2, 4000))
    )
    assert one.rows[0].dp == 1 and slow.rows[0].dp == fast.rows[0].dp == 2
    # the same DDP all-reduce over 2 nodes: 10x the network, less exposed time (NVLink's rate is not used)
    assert slow.rows[0].step_s > fast.rows[0].step_s
    assert slow.assumptions()["rates"]["network_gbps"] == 400


# --- nothing fits ---------------------------------------------------------------------------------


def test_nothing_fitting_names_the_nodes_or_pipeline_and_context_parallelism():
    kept = ["gpu=H100", "tp=8", "sp=true", "vp=true", "recompute=full"]
    done = runner.invoke(app, ["fit", "model=llama3_70b", "seq=131072", *kept])
    assert done.exit_code == 1 and done.stdout == "" and len(done.stderr.splitlines()) == 1
    assert "fits on 4 nodes (32 GPUs) with sharded DP, e.g. T 8 SP VP x FSDP 4" in done.stderr, done.stderr
    done = runner.invoke(app, ["fit", "model=llama3_405b", "seq=131072", *kept])  # 794 GiB on one node
    assert done.exit_code == 1 and len(done.stderr.splitlines()) == 1
    assert "nothing fits on up to 4096 nodes" in done.stderr
    assert "needs pipeline or context parallelism, which tpbench does not do" in done.stderr
