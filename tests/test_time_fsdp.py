"""The time model's FSDP2 (issue 60 item 2): each unit's all-gather and reduce-scatter hidden behind
the blocks' compute as torch's fully_shard schedules them (steptime.model.fsdp_exposed), the totals
the memory model's counted rows; and the published runs it is checked against (benchmarks/
published_throughput.py: torchtitan's FSDP runs on 64 A100s, 30-35% too slow while every FSDP2
collective was charged as exposed). All in-process, nothing runs a model."""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tpbench.predict import hardware
from tpbench.predict.steptime import Rates, gpu_rates, model, predict_time
from tpbench.predict.theory import comm_rows, dims
from tpbench.predict.theory.shards import ROOT, unit_shards, zero_buckets
from tpbench.run import compose
from tpbench.sizing import fit as fitting
from tpbench.sizing import search

pytestmark = pytest.mark.not_quick
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "published_throughput.py"


@functools.cache
def config(line: str):
    (cfg,) = compose.expand(["kind=throughput", "train.compile=false", *line.split()])
    return cfg


def rates(overlap: bool, alpha: float, beta: float) -> Rates:
    return Rates(
        gemm={"large": 1e10, "small": 1e10},
        attention=1e10,
        bandwidth=1e10,
        op_s=0.0,
        alpha=dict.fromkeys(KINDS, alpha),
        beta=dict.fromkeys(KINDS, beta),
        overlap=overlap,
        gpu=True,
        peak=1e10,
    )


def dp_seconds(cfg, r: Rates) -> tuple[float, float]:
    """(exposed, total) seconds of FSDP2's DP collectives in `cfg`'s predicted step."""
    got = predict_time(cfg, r)
    exposed = sum(got.comm_exposed.get(p, 0.0) for p in model.FSDP_PURPOSES)
    return exposed, got.comm_total_s


@pytest.mark.parametrize("level", ["full", "grads"])
def test_fsdp2_hides_each_blocks_collectives_behind_the_blocks_compute(level):
    """Collectives of negligible cost against a block's compute (one latency each, no bytes): exposed
    are the root's gathers, the first block's forward gather, the last reduce-scatters (first block's,
    root's) and, with full, the last block's backward gather less the head's backward (more than a
    latency here); every collective of the others hidden. Without cores to spare nothing hides."""
    cfg = config(f"mode=tp tp=1 dp=2 parallel.dp_shard={level} model.num_hidden_layers=4")
    alpha = 1e-9
    exposed, total = dp_seconds(cfg, rates(True, alpha, 0.0))
    gathers = 2 if level == "full" else 1
    assert exposed == pytest.approx(alpha * (gathers + 1 + 2))
    units = len(unit_shards(dims(cfg), 2))
    assert total == pytest.approx(alpha * units * (gathers + 1))  # every unit's gathers and reduce-scatter
    assert dp_seconds(cfg, rates(False, alpha, 0.0)) == pytest.approx((total, total))


def test_fsdp2_exposes_what_a_units_collectives_take_beyond_its_blocks_compute():
    """Collectives far longer than any compute: every one exposed, less at most a block's compute per
    unit hidden (forward's gathers behind the forward, backward's gathers and reduce-scatters behind
    the backward); the totals are comm_rows' at these rates."""
    cfg = config("mode=tp tp=1 dp=2 parallel.dp_shard=full model.num_hidden_layers=4")
    slow = rates(True, 1.0, 0.0)
    got = predict_time(cfg, slow)
    exposed, total = dp_seconds(cfg, slow)
    rows = [r for r in comm_rows(cfg) if r.purpose in model.FSDP_PURPOSES]
    assert total == pytest.approx(sum(r.count for r in rows))  # alpha 1 s a collective, no bytes
    d = dims(cfg)
    per_block = got.compute_s / d.L  # more than either phase's share of a block
    assert total - 2 * (d.L - 1) * per_block <= exposed < total


def test_the_units_share_the_counted_bytes_by_their_shard_sizes():
    """At beta only (no latency), the root's gathers exposed in full are its share of the gathered
    bytes: its shard's fraction of the rank's elements."""
    cfg = config("mode=tp tp=1 dp=2 parallel.dp_shard=grads model.num_hidden_layers=2")
    d = dims(cfg)
    shards = unit_shards(d, 2)
    beta = 1e-6
    colls = [c for c in model.step_collectives(d, comm_rows(cfg)) if c.purpose in model.FSDP_PURPOSES]
    block = {"forward": 1e9, "backward": 1e9}  # hides every block's
    got = model.fsdp_exposed(d, colls, rates(True, 0.0, beta), block, 1e9)
    gathered = sum(c.bytes for c in colls if c.purpose == "dp_params")
    reduced = sum(c.bytes for c in colls if c.purpose == "dp_grads")
    first = next(u for u in shards if u != ROOT)
    share = {u: n / sum(shards.values()) for u, n in shards.items()}
    seconds, hidden = got["dp_params"]
    assert seconds - hidden == pytest.approx(beta * gathered * (share[ROOT] + share[first]))
    seconds, hidden = got["dp_grads"]
    assert seconds - hidden == pytest.approx(beta * reduced * (share[ROOT] + share[first]))


ZERO1 = "mode=tp tp=1 dp=2 parallel.dp_shard=optimizer parallel.zero_bucket_elements=20000"


def test_zero1_hides_its_buckets_behind_backward_and_the_next_forward():
    """ZeRO-1's buckets (tpbench.parallel.zero) at negligible cost (one latency each, no bytes): of
    the reduce-scatters, the bottom bucket's (backward's last) and the late one's (after the TP
    sums) exposed; of the all-gathers, the first the forward needs; every other hidden. The old
    charge, every collective exposed at the step's end, would be the total; without cores to spare
    it is again."""
    cfg = config(ZERO1)
    buckets = zero_buckets(dims(cfg), 2)
    assert len(buckets) >= 3 and buckets[-1][1]  # several, the tied embedding's late one last
    alpha = 1e-9
    got = predict_time(cfg, rates(True, alpha, 0.0))
    assert got.comm_exposed["dp_grads"] == pytest.approx(2 * alpha)
    assert got.comm_exposed["dp_params"] == pytest.approx(alpha)
    exposed, total = dp_seconds(cfg, rates(True, alpha, 0.0))
    assert total == pytest.approx(2 * alpha * len(buckets)) and exposed < total
    assert dp_seconds(cfg, rates(False, alpha, 0.0)) == pytest.approx((total, total))


def test_zero1_buckets_share_the_counted_bytes_and_outlast_their_compute():
    """At beta only, the exposed reduce-scatters are the bottom and late buckets' shares of the counted
    bytes, the exposed all-gather the first bucket's (the late one: it holds the tied embedding), with
    the compute hiding the rest; collectives far longer than the compute are exposed but for it."""
    cfg = config(ZERO1)
    d = dims(cfg)
    buckets = zero_buckets(d, 2)
    whole = sum(n for n, _ in buckets)
    colls = [c for c in model.step_collectives(d, comm_rows(cfg)) if c.purpose in model.FSDP_PURPOSES]
    gathered = sum(c.bytes for c in colls if c.purpose == "dp_params")
    reduced = sum(c.bytes for c in colls if c.purpose == "dp_grads")
    beta = 1e-6
    got = model.zero1_exposed(d, colls, rates(True, 0.0, beta), 1e9, 1e9)
    seconds, hidden = got["dp_grads"]
    assert seconds - hidden == pytest.approx(beta * reduced * (buckets[-2][0] + buckets[-1][0]) / whole)
    seconds, hidden = got["dp_params"]
    assert seconds - hidden == pytest.approx(beta * gathered * buckets[-1][0] / whole)
    slow = model.zero1_exposed(d, colls, rates(True, 1.0, 0.0), 0.5, 0.25)
    n = len(buckets)
    assert slow["dp_grads"] == pytest.approx((n, 0.25)) and slow["dp_params"] == pytest.approx((n, 0.5))


@functools.cache
def published():
    spec = importlib.util.spec_from_file_location("published_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module, [(row, module.predicted(row)) for row in module.ROWS]


def test_torchtitans_in_scope_published_runs_are_within_20_percent():
    """Issue 60's goal on the rows tpbench models (bf16, eager; AC none, full, per-layer, and per-op as
    tpbench's recompute=op): the ten FSDP rows on A100s and H100s. Seen failing with FSDP2's collectives
    all exposed (-30% to -35%)."""
    script, results = published()
    assert sum(row.in_scope for row, _ in results) == 10
    assert script.missed(results) == [], script.table(results)


def test_the_goal_bites_and_the_directions_hold():
    """A row 21% off is named. Directions: Llama 2 13B at AC none beats per-layer AC (published and
    predicted); the H100 Llama 3.1 8B run beats the A100's (local batch 2 against 1); FSDP 128 is
    slower than FSDP 8 (both). Compile is not modelled: its rows are predicted as the eager ones."""
    script, results = published()
    row, p = next((r, p) for r, p in results if r.in_scope)
    assert script.missed([(row, dict(p, tokens_per_s=row.tokens_per_s * 1.21))])
    assert script.missed([(row, dict(p, tokens_per_s=row.tokens_per_s * 1.19))]) == []
    by = {(r.name, r.ac): (r, p) for r, p in results}
    none, layer = by[("Llama 2 13B, FSDP 64", "none")], by[("Llama 2 13B, FSDP 64", "selective layer")]
    assert none[0].tokens_per_s > layer[0].tokens_per_s and none[1]["tokens_per_s"] > layer[1]["tokens_per_s"]
    h100, a100 = by[("Llama 3.1 8B, FSDP 8", "selective op")], by[("Llama 3 8B, FSDP 64", "selective op")]
    assert h100[0].tokens_per_s > a100[0].tokens_per_s and h100[1]["tokens_per_s"] > a100[1]["tokens_per_s"]
    eight, many = by[("Llama 3.1 8B, FSDP 8", "selective op")], by[("Llama 3.1 8B, FSDP 128", "selective op")]
    assert eight[0].tokens_per_s > many[0].tokens_per_s
    assert eight[1]["tokens_per_s"] > many[1]["tokens_per_s"]
    # per-op AC between AC none and full (Llama 2 13B: published and predicted)
    op = by[("Llama 2 13B, FSDP 64", "selective op")]
    assert none[0].tokens_per_s > op[0].tokens_per_s and none[1]["tokens_per_s"] > op[1]["tokens_per_s"]


def test_torchtitans_published_max_reserved_is_reported_against_its_5_percent_goal():
    """Issue 59 item 5: each eager H100 row's max reserved and the FSDP 8 -> 128 change against the
    published figures, at 5%: not met today (-9.5%, -10.0%, the change -7.3% of the published), and the
    script names each miss, so that meeting it, or a figure moving, shows here."""
    script, results = published()
    change = script.memory_change(results)
    assert change is not None and change[0] == pytest.approx(67.0 - 82.4)
    missed = script.memory_missed(results)
    assert [line.split(":")[0] for line in missed] == [
        "Llama 3.1 8B, FSDP 8",
        "Llama 3.1 8B, FSDP 128",
        "FSDP 8 -> 128",
    ], missed
    by = {row.name: p for row, p in results}
    assert by["Llama 3.1 8B, FSDP 8"]["reserved_gib"] == pytest.approx(74.58, abs=0.01)
    assert by["Llama 3.1 8B, FSDP 128"]["reserved_gib"] == pytest.approx(60.30, abs=0.01)


def test_flash_attention_on_hopper_is_charged_at_flashattention_2s_published_share():
    """torch's SDPA runs FlashAttention-2, which reaches 35% of an H100's peak (FlashAttention-3's
    abstract), not the 72% it reaches on an A100: Hopper's attention rate is the lower one."""
    h100, h200, a100 = (gpu_rates(hardware.gpu(g), "bfloat16") for g in ("H100-SXM", "H200", "A100-80GB"))
    assert h100.attention == pytest.approx(0.35 * h100.peak)
    assert h200.attention == pytest.approx(0.35 * h200.peak)
    assert a100.attention == pytest.approx(0.72 * a100.peak)
    cfg = config(
        "model=llama3_8b seq=8192 train.micro_batch=1  launch.device=cuda launch.emulate=fake kind=memory"
    )
    faster = replace(h100, attention=0.72 * h100.peak)
    assert predict_time(cfg, h100).step_s > predict_time(cfg, faster).step_s


def test_hsdps_replica_all_reduce_crosses_the_network_when_its_shard_group_is_within_a_node():
    """HSDP with its shard group within a node (2 nodes of 8, FSDP 8 x 2 replicas): the gathers and
    reduce-scatters on NVLink, the all-reduce between the replicas (on the other node) at the
    network's rate. Seen failing with every DP collective at NVLink's rate there (as before)."""
    line = "model=qwen3_0_6b seq=2048 gpu=H100 nodes=2 tp=1 dp_shard=full dp_replicate=2 micro_batch=1"
    request = fitting.parse(f"{line} recompute=full".split())
    (base,) = compose.expand(request.overrides, single=True, launching=False)
    fit = fitting.solve(request, base)
    (row,) = [r for r in fit.rows if r.dp_replicate == 2 and not r.reason]
    cfg = fit.config(row)
    nvlink = gpu_rates(hardware.gpu("H100-SXM"), "bfloat16")
    network = search.Cluster(fit.gpu, 2, 8, fit.memory).network_rates(nvlink)
    mixed = replace(nvlink, beta={**nvlink.beta, "all_reduce": network.beta["all_reduce"]})
    timed, slow = predict_time(cfg, nvlink), predict_time(cfg, mixed)
    for p in search.DP_SYNC:
        timed.comm_exposed[p] = slow.comm_exposed.get(p, 0.0)
    assert row.step_s == pytest.approx(search.step_time(timed, row)[0])
    assert slow.comm_exposed["dp_grads"] > predict_time(cfg, nvlink).comm_exposed["dp_grads"]
