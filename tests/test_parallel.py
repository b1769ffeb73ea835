"""TP, SP and VP against dense, in real torchrun jobs over gloo (one launch checks many cases)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from beside import beside
from torchrun_checks import (
    BREAKS,
    DDP_HOLD_S,
    FAMILIES,
    FORCED_NUMEL,
    LLAMA31_ROPE,
    TINY,
    TOL_FWD,
    TOL_GRAD,
    TOL_PARAM,
    UNITS,
    WORLD2,
    WORLD4,
    WORLD8,
    B,
    D,
    H,
    L,
    S,
    agreed,
    per_config,
    same_on_every_rank,
)

from tpbench.experiments.criterion import CHECKS as VALIDATE_CHECKS
from tpbench.experiments.criterion import K
from tpbench.experiments.validate import DRIFT, logits_drift

# --- world 2: layers, collectives, loss, checkpoints, and every combination at T = 2 --------------

VALIDATE_T2 = {
    "tp": ["parallel.tp=2"],
    "tp_sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp_sp_keep_full": ["parallel.tp=2", "parallel.sp=true", "parallel.sp_regather=false"],
    # SP gathering in each column linear (minimind-tron's): its own shard re-gathered, or kept whole
    "tp_sp_linear": ["parallel.tp=2", "parallel.sp=true", "parallel.sp_gather=linear"],
    "tp_sp_linear_keep_full": [
        "parallel.tp=2",
        "parallel.sp=true",
        "parallel.sp_gather=linear",
        "parallel.sp_regather=false",
    ],
    "tp_vp": ["parallel.tp=2", "parallel.vp=true"],
    "tp_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
    "tp_sp_vp_v255_untied": [
        "parallel.tp=2",
        "parallel.sp=true",
        "parallel.vp=true",
        "model.vocab_size=255",
        "model.tie_word_embeddings=false",
    ],
    "tp_vp_pad8": [
        "parallel.tp=2",
        "parallel.vp=true",
        "parallel.vocab_pad_multiple=8",
        "model.vocab_size=250",
    ],
    "tp_kv1": ["parallel.tp=2", "model.num_key_value_heads=1", "parallel.sp=true"],
    "tp_sdpa": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true", "model.flash_attn=true"],
}

# every mode at bf16 pure and mixed (fp32 is above): each passes the same criterion, bounds from the
# dense model's own error against fp32; one gradient sum switched off still fails in bf16
MODES = {
    "tp": ["parallel.tp=2"],
    "tp_sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp_vp": ["parallel.tp=2", "parallel.vp=true"],
    "tp_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
    "tp_sp_linear_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true", "parallel.sp_gather=linear"],
    "ddp": ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=2"],
}
PRECISIONS = {
    "bf16": ["train.dtype=bfloat16"],
    "mixed": ["train.dtype=bfloat16", "train.precision=mixed"],
}
VALIDATE_T2 |= {
    f"{mode}_{precision}": [*overrides, *PRECISIONS[precision]]
    for mode, overrides in MODES.items()
    for precision in PRECISIONS
}
# parallel.overlap in every mode (and under autocast), each against the same mode without it
OVERLAP = ["parallel.overlap=true"]
VALIDATE_T2 |= {f"{mode}_overlap": [*MODES[mode], *OVERLAP] for mode in ("tp", "tp_sp", "tp_vp", "tp_sp_vp")}
VALIDATE_T2 |= {
    "tp_sp_keep_full_overlap": [*VALIDATE_T2["tp_sp_keep_full"], *OVERLAP],
    "tp_sp_linear_overlap": [*VALIDATE_T2["tp_sp_linear"], *OVERLAP],
    "tp_sp_linear_keep_full_overlap": [*VALIDATE_T2["tp_sp_linear_keep_full"], *OVERLAP],
    "tp_sp_vp_overlap_mixed": [*MODES["tp_sp_vp"], *PRECISIONS["mixed"], *OVERLAP],
    "broken_overlap_no_wait": [*MODES["tp_sp"], *OVERLAP, "debug.overlap_fault=no_wait"],
}
# train.fused_optimizer: the sharded model's AdamW fused (the dense reference's is not)
FUSED = ["train.fused_optimizer=true"]
VALIDATE_T2 |= {
    "tp_fused": [*MODES["tp"], *FUSED],
    "tp_sp_linear_vp_fused_mixed": [*MODES["tp_sp_linear_vp"], *PRECISIONS["mixed"], *FUSED],
}
# train.compile: each block compiled, its collectives custom ops in the graph. Inductor compiles
# tp_vp_compile_mixed; the others go to aot_eager (Dynamo's graph and AOTAutograd's split, eager
# kernels: what each mode changes is in the graph, not in inductor's code, and a cold inductor cache
# costs about 13 CPU s a config over 2 ranks, as on CI)
COMPILE = ["train.compile=true"]
AOT_EAGER = ["train.compile_backend=aot_eager"]
COMPILED = {  # compiled config -> the same config eager
    "tp_compile": "tp",
    "tp_sp_keep_full_compile": "tp_sp_keep_full",
    "tp_sp_linear_keep_full_compile": "tp_sp_linear_keep_full",
    "tp_vp_compile_mixed": "tp_vp_mixed",
    # with overlap: the pieces between the linears compiled, SP's re-gather kept
    "tp_sp_vp_overlap_compile_mixed": "tp_sp_vp_overlap_mixed",
}
INDUCTOR = ("tp_vp_compile_mixed",)
VALIDATE_T2 |= {
    name: [*VALIDATE_T2[off], *COMPILE, *([] if name in INDUCTOR else AOT_EAGER)]
    for name, off in COMPILED.items()
}
# mode=ddp: the DDP memory and throughput run (torch's, its comm hook, 0.05 MB buckets: several once
# rebuilt after the first backward), against dense; its hook broken, it fails
DDP = [*MODES["ddp"], "parallel.ddp_bucket_mb=0.05"]
VALIDATE_T2 |= {
    "ddp": DDP,
    "broken_ddp_no_divide": [*DDP, "debug.ddp_fault=no_divide"],
    "broken_ddp_drop_bucket": [*DDP, "debug.ddp_fault=drop_bucket"],
}
# an error on rank 1 only, in a parameter no other rank's figures hold (DDP's replica; TP's replicated
# final norm, which a gathered checkpoint takes from rank 0); the DDP one as a real `tpbench sweep`, a
# failed run end to end, in tests/test_runner.py (test_a_validation_out_of_bounds_is_a_failed_run_...)
PLANTED = {
    "planted_rank1_ddp": [*DDP, "debug.validate_fault=rank1_param"],
    "planted_rank1_tp": [*MODES["tp"], "debug.validate_fault=rank1_param"],
}
VALIDATE_T2 |= PLANTED
# validate.batch=fixed: the seed's check, every AdamW step on the forward check's batch; and a drift
# bound below any fp32 drift, which must fail the run
FIXED = {"tp_fixed": "tp", "tp_sp_vp_fixed": "tp_sp_vp"}  # fixed -> the same mode fresh
VALIDATE_T2 |= {name: [*MODES[fresh], "validate.batch=fixed"] for name, fresh in FIXED.items()}
VALIDATE_T2["tight_drift"] = [*MODES["tp"], "validate.k=0", "validate.tol_drift=1e-12"]
# model.dropout: each mask a hash of the element's dense position (tpbench.models.dropout), so every
# mode, recompute and overlap draw the dense model's masks (each recompute setting and overlap folded
# into a mode: one launch's seconds each); with one dim's offset left out (every rank drawing part 0's
# mask there: one seed where the shards need their own) validation fails, at its first step already
DROPOUT = ["model.dropout=0.1"]
VALIDATE_T2 |= {
    "dropout_tp": [*MODES["tp"], *DROPOUT],
    "dropout_tp_sp": [*MODES["tp_sp"], *DROPOUT],
    "dropout_tp_sp_linear_overlap": [*VALIDATE_T2["tp_sp_linear"], *OVERLAP, *DROPOUT],
    "dropout_tp_vp_selective": [*MODES["tp_vp"], "train.recompute=selective", *DROPOUT],
    "dropout_tp_sp_vp_full": [*MODES["tp_sp_vp"], "train.recompute=full", *DROPOUT],
    "dropout_ddp": [*DDP, *DROPOUT],
}
ONE_STEP = ["validate.steps=1", "validate.every=1"]
MISPLACED = {
    f"misplaced_dropout_no_{dim}_offset": [*mode, *DROPOUT, f"debug.dropout_fault=no_{dim}_offset", *ONE_STEP]
    for dim, mode in (("seq", MODES["tp_sp"]), ("head", MODES["tp"]), ("batch", DDP))
}
VALIDATE_T2 |= MISPLACED
VALIDATE_T2 |= {
    "broken_qk_norm_bf16": ["parallel.tp=2", "train.dtype=bfloat16", "debug.skip_grad_sum=[qk_norm]"],
    "broken_sp_norms_mixed": [
        "parallel.tp=2",
        "parallel.sp=true",
        *PRECISIONS["mixed"],
        "debug.skip_grad_sum=[sp_norms]",
    ],
}

FAMILY_MODES = {"tp": [], "tp_sp": ["parallel.sp=true"], "tp_vp": ["parallel.vp=true"]}
FAMILY_MODES["tp_sp_vp"] = FAMILY_MODES["tp_sp"] + FAMILY_MODES["tp_vp"]
FAMILY_MODES["tp_sp_linear"] = [*FAMILY_MODES["tp_sp"], "parallel.sp_gather=linear"]
VALIDATE_T2 |= {
    f"{family}_{mode}": ["parallel.tp=2", *overrides, *FAMILY_MODES[mode]]
    for family, overrides in FAMILIES.items()
    for mode in FAMILY_MODES
    if family == "qwen25" or mode in ("tp", "tp_sp_vp")
}
VALIDATE_T2["llama31_tp_sp_vp"] = [*VALIDATE_T2["llama_tp_sp_vp"], *LLAMA31_ROPE]
# parallel.overlap with q, k, v biases: each bias gradient deferred with its weight's
VALIDATE_T2["qwen25_tp_sp_vp_overlap"] = [*VALIDATE_T2["qwen25_tp_sp_vp"], *OVERLAP]

# --- world 4: T = 4, DP x TP, T = 1 with DP, GQA replication, and each gradient sum switched off ---

VALIDATE_W4 = {
    "t4_tp": ["parallel.tp=4"],
    "t4_tp_sp": ["parallel.tp=4", "parallel.sp=true"],
    "t4_tp_vp": ["parallel.tp=4", "parallel.vp=true"],
    "t4_tp_sp_vp": ["parallel.tp=4", "parallel.sp=true", "parallel.vp=true"],
    "t4_tp_sp_linear_keep_full_kv1": [
        "parallel.tp=4",
        "parallel.sp=true",
        "parallel.sp_gather=linear",
        "parallel.sp_regather=false",
        "model.num_key_value_heads=1",
    ],
    "t4_kv1": ["parallel.tp=4", "model.num_key_value_heads=1"],
    "t4_kv2_sp_vp_v250": [
        "parallel.tp=4",
        "model.num_key_value_heads=2",
        "parallel.sp=true",
        "parallel.vp=true",
        "model.vocab_size=250",
    ],
    "dp2_tp2": ["parallel.tp=2", "parallel.dp=2"],
    "dp2_tp2_sp_vp": ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", "parallel.vp=true"],
    "dp4_t1": ["parallel.tp=1", "parallel.dp=4"],
    # 0.05 MB buckets: the tiny model's DP gradient sum goes in 8 of them, launched during backward
    "dp2_tp2_overlap": ["parallel.tp=2", "parallel.dp=2", *OVERLAP, "parallel.ddp_bucket_mb=0.05"],
    "dp2_tp2_sp_vp_overlap": [
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.sp=true",
        "parallel.vp=true",
        *OVERLAP,
        "parallel.ddp_bucket_mb=0.05",
    ],
    "t4_tp_sp_vp_overlap": ["parallel.tp=4", "parallel.sp=true", "parallel.vp=true", *OVERLAP],
    "broken_overlap_early_bucket": [
        "parallel.tp=2",
        "parallel.dp=2",
        *OVERLAP,
        "parallel.ddp_bucket_mb=0.05",
        "debug.overlap_fault=early_bucket",
    ],
    "broken_qk_norm": ["parallel.tp=4", "debug.skip_grad_sum=[qk_norm]"],
    "broken_kv_replicas": [
        "parallel.tp=4",
        "model.num_key_value_heads=1",
        "debug.skip_grad_sum=[kv_replicas]",
    ],
    "broken_sp_norms": ["parallel.tp=4", "parallel.sp=true", "debug.skip_grad_sum=[sp_norms]"],
    "broken_dp": ["parallel.tp=2", "parallel.dp=2", "debug.skip_grad_sum=[dp]"],
    "dropout_dp2_tp2_sp_vp": [
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.sp=true",
        "parallel.vp=true",
        *DROPOUT,
    ],
}


# Each family at T 4 (its KV heads replicated or split as its GQA shape asks) in TP alone, SP+VP and SP's
# linear gather; tp_sp and tp_vp at T 4 are the tiny model's above (a family changes the attention,
# not SP's or VP's edges: those run at T 2 for Qwen2.5 in every mode)
FAMILY_T4_MODES = ("tp", "tp_sp_vp", "tp_sp_linear")
VALIDATE_W4 |= {
    f"t4_{family}_{mode}": ["parallel.tp=4", *overrides, *FAMILY_MODES[mode]]
    for family, overrides in FAMILIES.items()
    for mode in FAMILY_T4_MODES
}

# --- world 8: every TP mode at T = 8, the tiny model's largest (its 4 KV heads each on two ranks; 8 for
# the DTensor engine, which cannot replicate them; S 32 in shards of 4; V 256 in shards of 32), and a
# gradient sum switched off failing there too. Two AdamW steps: 8 ranks share the 2 cores ------------

T8 = ["parallel.tp=8", "validate.steps=2", "validate.every=1"]
VALIDATE_T8 = {f"t8_{mode}": [*T8, *overrides] for mode, overrides in FAMILY_MODES.items()}
VALIDATE_T8 |= {
    f"t8_dtensor_{mode}": [*T8, "parallel.engine=dtensor", "model.num_key_value_heads=8", *FAMILY_MODES[mode]]
    for mode in ("tp", "tp_sp", "tp_vp", "tp_sp_vp")
}
VALIDATE_T8["broken_t8_sp_norms"] = [*T8, "parallel.sp=true", "debug.skip_grad_sum=[sp_norms]"]


# the world-2 and world-4 jobs, shared with test_recompute, test_theory and test_emulation
WORLD2.add("units", "parallel", {unit: [] for unit in UNITS})
WORLD2.add("validate", "parallel", {k: TINY + v for k, v in VALIDATE_T2.items()})
WORLD4.add("validate", "parallel", {k: TINY + v for k, v in VALIDATE_W4.items()})
WORLD8.add("validate", "parallel", {k: TINY + v for k, v in VALIDATE_T8.items()})


@beside
def units(folder: Path) -> list[dict]:
    """Every rank's unit checks (a list, rank 0's first): each test reads every rank's."""
    return WORLD2.part(folder, "units", "parallel")


@beside
def validated_ranks(folder: Path) -> dict[str, list[dict]]:
    """Per config, every rank's validation results."""
    w2, w4, w8 = (shared.part(folder, "validate", "parallel") for shared in (WORLD2, WORLD4, WORLD8))
    return per_config(w2) | per_config(w4) | per_config(w8)


@pytest.fixture(scope="module")
def validated(validated_ranks) -> dict[str, dict]:
    """Rank 0's results per config (each figure is the worst over the job's ranks: the same on each)."""
    return {name: ranks[0] for name, ranks in validated_ranks.items()}


def test_every_rank_reports_the_same_verdict_figures_and_collectives(validated_ranks):
    """Each figure is reduced over the job, so every rank reports rank 0's; and every rank counted the
    same collectives and drew the same batches (a rank that drifted apart would differ here). The
    failed checks' lines and the parameters' rows are rank 0's alone: what the database records."""
    for name, ranks in validated_ranks.items():
        assert len(ranks) == (2 if name in VALIDATE_T2 else 4 if name in VALIDATE_W4 else 8), name
        shared = ("metrics", "drift", "curves", "draws", "comm")
        same_on_every_rank([{k: rank[k] for k in shared} for rank in ranks])


def test_the_sign_rule_writes_the_gradients_where_the_step_reads_them(validated_ranks):
    """validate's sign rule mends gradients through write_gradients: for every config here (both
    engines, T 2 to 8, DP, overlap's deferred weights), every gradient doubled, read back doubled
    (then restored), on every rank."""
    for name, ranks in validated_ranks.items():
        assert [rank["write_gradients_error"] for rank in ranks] == [0.0] * len(ranks), name


def test_collectives_forward_and_backward(units):
    for rank, checks in enumerate(units):
        for name, value in checks["collectives"].items():
            assert value == 0.0, (rank, name)


def test_layers_match_nn_linear_embedding_and_cross_entropy(units):
    for rank, checks in enumerate(units):
        layers = dict(checks["layers"])
        assert layers.pop("ce_all_reduces") == 3, rank  # max, target logit, sum of exp
        assert layers.pop("ce_other_collectives") == 0, rank  # and nothing in backward
        for name, value in layers.items():
            assert value < 1e-5, (rank, name)


def test_print_model_shows_where_each_collective_sits(units):
    """Each region's entry prints first in its module, each exit on the layer that ends the region."""
    tp_sp_vp, tp_sp = units[0]["regions"]["tp_sp_vp"], units[0]["regions"]["tp_sp"]
    gather = "SPGather(all-gather over tp 2; backward reduce-scatter; saves the shard, re-gathers)"
    for region in ("(self_attn): Attention(\n", "(mlp): FeedForward(\n"):
        assert tp_sp_vp.count(f"{region}          (entry): {gather}\n") == 1, region
    assert tp_sp_vp.count("RowParallelLinear(") == tp_sp_vp.count("exit reduce_scatter over tp 2)") - 1 == 2
    assert (
        "(embed_tokens): VocabParallelEmbedding(vocab rows 0..127, 64; exit reduce_scatter over tp 2)"
        in tp_sp_vp
    )
    assert f"(lm_head): ColumnParallelLinear(\n    64 -> 128\n    (entry): {gather}\n  )" in tp_sp_vp
    assert "(exit): SPScatter(split over tp 2; backward all-gather)\n    )" in tp_sp
    assert (
        "(norm): RMSNorm(\n      (exit): SPGatherReplicated(all-gather over tp 2; backward split)\n" in tp_sp
    )
    assert tp_sp.count("(entry)") == 2  # the LM head is replicated: entered by the final norm's exit


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_and_the_plan_compose_in_either_order(units, mode):
    for rank, checks in enumerate(units):
        regions = checks["regions"]
        assert regions[f"{mode}_same_classes"], rank
        assert regions[f"{mode}_same_collectives"], rank
        assert regions[f"{mode}_same_loss"], rank
        assert regions[f"{mode}_same_grads"], rank


def test_a_step_neither_syncs_the_host_nor_rebuilds_rope_tables(units):
    """On every rank: at V 255 the padded column is the last rank's, whose masking must not sync either."""
    assert [checks["step_ops"] for checks in units] == [{"host_syncs": 0, "rope_builds": 0}] * len(units)


def test_a_settled_collective_returns_with_its_tensors_let_go(units):
    """Under instrumentation.settling (memory runs) gloo's worker holds no tensor of a collective on return,
    so a tensor dropped after it is freed at the same op on every rank; without, some are held."""
    for rank, checks in enumerate(units):
        assert checks["settling"]["settled"] == 0, rank
        assert checks["settling"]["settled_async"] == 0, rank  # parallel.overlap's settle at wait()
        # the storage too: held through the worker's views when the tensor's own count is back to one
        assert checks["settling"]["settled_storage"] == 0, rank
        assert checks["settling"]["settled_clones"] == 0, (
            rank
        )  # gloo's reduce-scatter: the clone it all-reduced
        assert checks["settling"]["settled_functional"] == 0, rank  # the dtensor engine's, under PeakTracker


def test_a_backend_letting_go_late_is_waited_for_and_the_peak_stays_exact(units):
    """gloo's race forced (torchrun_checks.released_late): a stand-in for its worker lets go of an
    all-reduce's tensor 0.3 s late. Without settling it frees the input after the caller made another
    tensor of that size: the peak holds two, the tracker counts one late free. Settling hands the
    worker a staging copy that no tracker sees: the caller frees its input itself, the peak is one
    tensor, no free lands late; unstaged (DDP's buckets), settling waits for the worker, however long."""
    one = 4 * FORCED_NUMEL  # fp32 bytes of the all-reduced tensor, and of the one made after it
    for rank, checks in enumerate(units):
        s = checks["settling"]
        assert (s["forced_late_peak"], s["forced_late_frees"]) == (2 * one, 1), rank  # the race, forced
        assert (s["forced_settled_peak"], s["forced_settled_late_frees"]) == (one, 0), rank  # staged
        assert (s["forced_unstaged_peak"], s["forced_unstaged_late_frees"]) == (one, 0), rank  # waited
        # staged, the worker is handed a copy no tracker counts; unstaged, the caller's own tensor
        assert (s["forced_settled_tracked_handed"], s["forced_unstaged_tracked_handed"]) == (0, 1), rank


def test_an_async_collective_counts_as_blocking_and_times_its_wait_as_exposed(units):
    for checks in units:
        t = checks["async_timing"]
        assert (
            (t["async_count"], t["async_bytes"]) == (t["blocking_count"], t["blocking_bytes"]) == (1, 2**18)
        )
        assert t["blocking_exposed_s"] == t["blocking_time_s"] > 0
        # launch to completion, within the check's launch-to-seen-complete, not to the wait 0.1 s later
        assert 0 < t["async_time_s"] <= t["async_window_s"]
        assert 0 <= t["async_exposed_s"] <= t["async_wait_s"]  # its wait, not the other work before it
        # timed from its wait: within the call of wait(), not from the launch 0.1 s before it
        assert t["no_future_count"] == 1
        assert 0 < t["no_future_time_s"] == t["no_future_exposed_s"] <= t["no_future_wait_s"]


def test_ddp_buckets_are_timed_like_our_collectives_and_waited_where_ddp_waits(units):
    """Rank 1 holds its last bucket back until rank 0 waits for it at the end of its backward, then
    DDP_HOLD_S more (torchrun_checks.check_ddp_timing): rank 0's timed wait lasts until rank 1 lets go.
    Waited after DDP's own wait, rank 0 would never wait for it in its timed wait while rank 1 holds."""
    waiting, late = units[0]["ddp_timing"]  # gathered from both ranks
    for rank in (waiting, late):
        assert (rank["op"], rank["purpose"]) == ("all_reduce", "dp_grads")
        assert rank["count"] == rank["buckets"] > 1
        assert 0 <= rank["exposed_s"] <= rank["time_s"]
    assert late["signalled"] == 1  # rank 0 began its timed wait for the last bucket while rank 1 held it
    held = late["released"] - waiting["last_wait_began"]  # >= DDP_HOLD_S: rank 1 slept after the signal
    assert DDP_HOLD_S <= held <= waiting["exposed_s"] <= waiting["time_s"]


def test_overlap_hides_each_collective_behind_compute(units):
    """parallel.overlap launches each backward collective as soon as its input exists and waits where
    its result is first needed, with matmuls between: the entry's all-reduce (TP) or reduce-scatter
    (SP) behind the deferred weight gradients, every SP re-gather prefetched behind the exit's and the
    core's backward, every one of them async (2 layers: 2 regions each, or 5 column linears each);
    the DP buckets behind the rest of backward, all but those it completes last."""
    for checks in units:  # every rank launches and waits at the same places
        order = checks["overlap_order"]
        assert {p: len(h) for p, h in order["tp"].items()} == {"activation": 4}
        assert {p: len(h) for p, h in order["tp_sp"].items()} == {"activation": 4, "regather": 4}
        assert {p: len(h) for p, h in order["tp_sp_linear"].items()} == {"activation": 10, "regather": 10}
        # train.compile with overlap: the pieces between the linears compiled, the same launches and waits
        assert {p: len(h) for p, h in order["tp_sp_compile"].items()} == {"activation": 4, "regather": 4}
        for name in ("tp", "tp_sp", "tp_sp_linear", "tp_sp_compile"):
            for purpose, hidden in order[name].items():
                assert min(hidden) >= 1, (name, purpose, hidden)
        buckets = order["dp2"]["dp_grads"]  # launch order: the first filled first, the late one last
        assert set(order["dp2"]) == {"dp_grads"} and len(buckets) > 4
        assert sum(h >= 1 for h in buckets) > len(buckets) // 2 and buckets == sorted(buckets, reverse=True)


def test_checkpoint_round_trip_is_bit_exact(units):
    for rank, checks in enumerate(units):
        ck = checks["checkpoints"]
        for case in ("tp", "kv_replicated", "vp_padded_untied", "qwen25_kv_replicated", "qwen3_sp_vp"):
            assert ck[f"{case}_same_names"] == 1.0, (rank, case)
            assert ck[f"{case}_shapes_equal"] == 1.0, (rank, case)  # padded vocab rows are dropped
            assert ck[f"{case}_max_abs"] == 0.0, (rank, case)


BROKEN = [k for k in (*VALIDATE_T2, *VALIDATE_W4, *VALIDATE_T8) if k.startswith("broken")]
IN_BF16 = [k for k in VALIDATE_T2 if k.endswith(("bf16", "mixed")) and k not in BROKEN]
EXPECTED_TO_FAIL = (*BROKEN, *PLANTED, *MISPLACED, "tight_drift")
FP32 = [k for k in (*VALIDATE_T2, *VALIDATE_W4, *VALIDATE_T8) if k not in (*EXPECTED_TO_FAIL, *IN_BF16)]


@pytest.mark.parametrize("name", FP32)
def test_every_combination_equals_dense(validated, name):
    m = validated[name]["metrics"]
    assert m["fwd_logits_max_abs"] <= TOL_FWD
    assert m["loss_abs_diff"] <= TOL_FWD
    assert m["grad_max_rel_l2"] <= TOL_GRAD
    assert m["adamw_param_max_abs"] <= TOL_PARAM
    # the reference, the dense model in fp64, measures fp32's own rounding: not 0, under the floor (the
    # worst over every step's gradients: 4.3e-6 at step 6 with the untied padded vocabulary)
    assert 0 < m["dense_grad_max_rel_l2"] < TOL_GRAD
    assert m["passed"] == 1.0
    assert validated[name]["failed"] == []
    assert len(validated[name]["drift"]) == 2  # logits compared at steps 3 and 6


@pytest.mark.parametrize("name", IN_BF16)
def test_every_mode_equals_dense_in_its_own_precision(validated, name):
    """bf16 is ~1e-2 off fp32, far over the fp32 tolerances: each check is bounded by K times the dense
    model's own error in the same precision against fp32, and stays well within it."""
    m = validated[name]["metrics"]
    if not name.startswith("ddp"):  # DDP's ranks compute the dense forward itself, bit for bit
        assert m["fwd_logits_max_abs"] > 100 * TOL_FWD  # bf16 rounding: fp32's tolerance would fail it
    failed = validated[name]["failed"]
    for check, *_, free in VALIDATE_CHECKS:  # each one's worst item within K x its reference + floor
        if not free:  # the free-running checks are reported without a verdict in bf16 and mixed
            assert m[f"{check}_of_bound"] <= 1, check
    for own in ("dense_fwd_logits_max_abs", "dense_grad_max_rel_l2", "dense_adamw_param_max_rel_l2"):
        assert m[own] > 100 * TOL_FWD, own  # the dense model in bf16 is itself off fp32
    # against how far a parameter moved, the dense model's or the reference's: the norm weights do
    # not move in bf16 (updates under half an ulp of 1.0), the reference's do
    assert m["dense_adamw_param_max_rel_l2"] < 10
    assert failed == []
    assert m["passed"] == (0.0 if failed else 1.0)


@pytest.mark.parametrize("name", BROKEN)
def test_each_gradient_sum_is_needed(validated, name):
    m = validated[name]["metrics"]
    bound = K * m["dense_fwd_logits_max_abs"] + TOL_FWD
    assert m["fwd_logits_max_abs"] <= bound  # forward is untouched by a gradient sum
    assert m["grad_max_rel_l2"] > 0.1
    assert m["grad_max_rel_l2"] > K * m["dense_grad_max_rel_l2"]
    assert m["passed"] == 0.0
    assert any(f.startswith("grad_rel_l2 model.") for f in validated[name]["failed"])  # names the parameter


ALL_VALIDATED = VALIDATE_T2 | VALIDATE_W4 | VALIDATE_T8
BREAKING = {name: BREAKS[o] for name in BROKEN for o in ALL_VALIDATED[name] if o in BREAKS}


@pytest.mark.parametrize("name", sorted(BREAKING))
def test_a_planted_fault_fails_exactly_the_gradients_it_breaks(validated, name):
    """The gradient check fails the parameters the fault breaks, each past its own bound (K x the
    dense model's error against the reference + the floor), names one of them as its worst, and
    passes every other parameter."""
    breaks, rows = re.compile(BREAKING[name]), validated[name]["params"]
    failing = {n for n, (error, reference) in rows.items() if error > K * reference + TOL_GRAD}
    assert failing == {n for n in rows if breaks.search(n)} and failing
    (line,) = [f for f in validated[name]["failed"] if f.startswith("grad_rel_l2 ")]
    assert breaks.search(line.split()[1]), line


@pytest.mark.parametrize("name", MISPLACED)
def test_each_dropout_offset_is_needed(validated, name):
    """A shard that draws another part's mask (its sequence shard's under SP, its heads' in attention,
    its DP slice of the batch) is a different model: every check fails, the forward first."""
    m = validated[name]["metrics"]
    assert m["fwd_logits_max_abs"] > 1e-2 and m["grad_max_rel_l2"] > 0.1
    assert m["passed"] == 0.0
    assert [f.split()[0] for f in validated[name]["failed"]][:2] == ["fwd_logits_max_abs", "loss_abs_diff"]


@pytest.mark.parametrize("name", PLANTED)
def test_an_error_on_rank_1_fails_rank_0s_verdict_too(validated, name):
    """Every figure is the worst over all ranks: rank 0 (whose result this is) reports rank 1's
    planted error of 1 in its final parameters, and fails; the checks before the AdamW steps pass."""
    m = validated[name]["metrics"]
    assert m["adamw_param_max_abs"] == pytest.approx(1.0, abs=TOL_PARAM)
    assert m["passed"] == 0.0
    assert [f.split()[:2] for f in validated[name]["failed"]] == [["adamw_param_rel_l2", "model.norm.weight"]]


@pytest.mark.parametrize("name", FIXED)
def test_a_fixed_batch_check_trains_every_step_on_the_forward_checks_batch(validated, name):
    """validate.batch=fixed draws one batch, the forward check's, for all 6 AdamW steps and the logits'
    comparisons; fresh draws that one, one kept aside for the comparisons, and one per step."""
    fixed, fresh = validated[name], validated[FIXED[name]]
    assert (fixed["draws"], fresh["draws"]) == (1, 1 + 1 + 6)
    for check in ("fwd_logits_max_abs", "loss_abs_diff"):  # the same first batch
        assert fixed["metrics"][check] == fresh["metrics"][check], check
    # the gradients are checked at each AdamW step's batch: fresh's first is a batch of its own
    assert fixed["curves"] != fresh["curves"]  # trained on other batches, compared on another
    assert fixed["failed"] == [] and fixed["metrics"]["passed"] == 1.0


@pytest.mark.parametrize("name", [n for n in (*FP32, *IN_BF16) if n not in VALIDATE_T8])  # T 8: 2 steps
def test_each_compared_step_records_the_logits_mean_max_and_relative_l2(validated, name):
    """At steps 3 and 6, fresh and fixed alike; the check's figure is the max |diff|'s worst step."""
    r = validated[name]
    curves = {n: dict(map(tuple, c)) for n, c in r["curves"].items()}
    mean, top, rel = (curves[n] for n in DRIFT)
    assert list(mean) == list(top) == list(rel) == [3, 6]
    for step in (3, 6):
        assert 0 <= mean[step] <= top[step] and 0 <= rel[step] < 1, step
    assert r["metrics"]["adamw_drift_max_abs"] == max(top.values())


def test_logits_drift_figures():
    """mean |diff|, max |diff| and ||diff|| / ||dense|| of a known pair: one element off by 2 of four."""
    dense = torch.tensor([[[1.0, 2.0], [3.0, 6.0]]])
    sharded = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]], dtype=torch.bfloat16)
    assert logits_drift(sharded, dense) == pytest.approx([0.5, 2.0, 2 / 50**0.5])


def test_the_drift_bound_fails_the_run(validated):
    """validate.tol_drift is the floor of the AdamW logits drift's worst step: with k = 0 (no room for the
    dense model's own drift against fp64, which is measured, not 0) and the floor below the drift, that
    check alone fails, and with it the run; the same drift passes the default bound (k = 0 also
    narrows the sign rule's allowance to the floor's, so the figure is not the `tp` run's bit for bit)."""
    r = validated["tight_drift"]
    assert [f.split()[0] for f in r["failed"]] == ["adamw_drift_max_abs"]
    assert r["metrics"]["passed"] == 0.0 and r["metrics"]["dense_adamw_drift_max_abs"] > 0
    tp = validated["tp"]["metrics"]
    default_bound = tp["adamw_drift_max_abs"] / tp["adamw_drift_max_abs_of_bound"]
    assert 0 < r["metrics"]["adamw_drift_max_abs"] <= default_bound


def test_debug_faults_are_refused_where_they_break_nothing():
    """debug.ddp_fault breaks DDP's hook: refused with another engine; debug.validate_fault plants an
    error on rank 1 of a validation: refused for another kind or a single rank. One line, exit 2."""
    from typer.testing import CliRunner

    from tpbench.cli import app

    for args, says in [
        (["debug.ddp_fault=no_divide"], "debug.ddp_fault=no_divide: breaks DDP's comm hook, accepted with "),
        (["mode=ddp", "debug.ddp_fault=halve"], "debug.ddp_fault='halve': accepted are '', 'no_divide'"),
        (["kind=memory", "debug.validate_fault=rank1_param"], "with kind=memory and 2 rank(s): plants"),
        (["tp=1", "debug.validate_fault=rank1_param"], "with kind=validate and 1 rank(s): plants"),
    ]:
        result = CliRunner().invoke(app, ["run", *args])
        assert result.exit_code == 2 and result.stdout == "", args
        assert len(result.stderr.splitlines()) == 1 and says in result.stderr, (args, result.stderr)


def test_semantics_cover_every_layout(validated):
    seen = set(validated["t4_tp"]["semantics"]) | set(validated["t4_tp_sp_vp"]["semantics"])
    assert {"column", "row", "replicated", "replicated_sum", "vocab"} <= seen
    assert "kv_replicated" in validated["t4_kv1"]["semantics"]
    assert "kv_replicated" in validated["t4_qwen25_tp"]["semantics"]  # its k/v biases with the weights


# --- collectives per training step: what the math gives ---------------------------------------


def expected_comm(
    t: int,
    sp: bool,
    vp: bool,
    regather: bool = True,
    dp: int = 1,
    params: int = 0,
    per_linear: bool = False,
    head_norms: int = D,
) -> dict:
    """(op, purpose) -> (count, per-rank ring bytes) for one step of the tiny fp32 model;
    `head_norms`: the width of its q/k norms (the head dim; 0: model.qk_norm off)."""
    act = S * B * H * 4  # one [S, B, H] fp32 tensor
    ring_ar, ring_ag = 2 * (t - 1) / t, (t - 1) / t
    out: dict[tuple[str, str], tuple[int, int]] = {}
    if not sp:  # 2 all-reduces per block forward (f-bar) and 2 backward (f); VP adds embedding + head
        n = 4 * L + (2 if vp else 0)
        out[("all_reduce", "activation")] = (n, round(n * act * ring_ar))
    else:  # per block: g and g-bar forward, their conjugates backward; edges for embedding and head
        g = 5 if per_linear else 2  # g at each column linear (q, k, v, gate, up) or at each region
        n = (g + 2) * L + 2
        out[("all_gather", "activation")] = (n, round(n * act * ring_ag))
        out[("reduce_scatter", "activation")] = (
            (g + 2) * L + (2 if vp else 0),
            round(((g + 2) * L + (2 if vp else 0)) * act * ring_ag),
        )
        if regather:
            n_re = g * L + (1 if vp else 0)
            out[("all_gather", "regather")] = (n_re, round(n_re * act * ring_ag))
    if vp:
        out[("all_reduce", "loss")] = (3, round(3 * S * B * 4 * ring_ar))
    sums = 2 * L * head_norms + ((2 * L + 1) * H if sp else 0)  # q/k norms, and the SP norms
    if sums:
        out[("all_reduce", "grad_sum")] = (1, round(sums * 4 * ring_ar))
    return out


@pytest.mark.parametrize(
    "name,t,sp,vp,regather,per_linear,head_norms",
    [
        ("tp", 2, False, False, True, False, D),
        ("tp_sp", 2, True, False, True, False, D),
        ("tp_sp_keep_full", 2, True, False, False, False, D),
        ("tp_sp_linear", 2, True, False, True, True, D),
        ("tp_sp_linear_keep_full", 2, True, False, False, True, D),
        ("tp_vp", 2, False, True, True, False, D),
        ("tp_sp_vp", 2, True, True, True, False, D),
        ("t4_tp", 4, False, False, True, False, D),
        ("t4_tp_sp", 4, True, False, True, False, D),
        ("t4_tp_vp", 4, False, True, True, False, D),
        ("t4_tp_sp_vp", 4, True, True, True, False, D),
        # the families: no q/k norms (Llama, Qwen2.5: no grad_sum at all without SP), Qwen3's of 16
        ("llama_tp", 2, False, False, True, False, 0),
        ("llama_tp_sp_vp", 2, True, True, True, False, 0),
        ("qwen25_tp_sp", 2, True, False, True, False, 0),
        ("qwen3_tp", 2, False, False, True, False, 16),
        ("t4_qwen3_tp_sp_vp", 4, True, True, True, False, 16),
        ("t4_qwen3_tp_sp_linear", 4, True, False, True, True, 16),
    ],
)
def test_collectives_per_step_match_the_math(validated, name, t, sp, vp, regather, per_linear, head_norms):
    counted = {(op, purpose): (n, b) for op, purpose, n, b in validated[name]["comm"]}
    assert counted == expected_comm(t, sp, vp, regather, per_linear=per_linear, head_norms=head_norms)


def test_sp_moves_the_same_bytes_as_tp_inside_the_blocks(validated):
    def block_bytes(name: str) -> int:
        # activation traffic less the two edge ops SP adds around the replicated embedding and head
        rows = validated[name]["comm"]
        total = sum(b for op, purpose, n, b in rows if purpose == "activation")
        edge = 2 * S * B * H * 4 // 2 if "sp" in name else 0
        return total - edge

    assert block_bytes("tp_sp_keep_full") == block_bytes("tp")


def test_dp_all_reduces_every_gradient_once(validated):
    counted = {(op, purpose): (n, b) for op, purpose, n, b in validated["dp4_t1"]["comm"]}
    assert set(counted) == {("all_reduce", "dp_grads")}
    assert counted[("all_reduce", "dp_grads")][0] == 1


# --- parallel.overlap: the same numbers, the same collectives -----------------------------------

OVERLAPPED = {  # overlap config -> the same config without overlap
    "tp_overlap": "tp",
    "tp_sp_overlap": "tp_sp",
    "tp_vp_overlap": "tp_vp",
    "tp_sp_vp_overlap": "tp_sp_vp",
    "tp_sp_keep_full_overlap": "tp_sp_keep_full",
    "tp_sp_linear_overlap": "tp_sp_linear",
    "tp_sp_linear_keep_full_overlap": "tp_sp_linear_keep_full",
    "tp_sp_vp_overlap_mixed": "tp_sp_vp_mixed",
    "t4_tp_sp_vp_overlap": "t4_tp_sp_vp",
    "dp2_tp2_overlap": "dp2_tp2",
    "dp2_tp2_sp_vp_overlap": "dp2_tp2_sp_vp",
    "qwen25_tp_sp_vp_overlap": "qwen25_tp_sp_vp",
}


@pytest.mark.parametrize("name", OVERLAPPED)
def test_overlap_changes_no_number(validated, name):
    """Every sum is made in the same order with overlap on (the deferred weight gradients are the
    same matmuls; the DP buckets sum each element over the same two ranks): bit-identical gradients,
    AdamW runs and logits, so every check's value is the same float."""
    on, off = validated[name], validated[OVERLAPPED[name]]
    shared = "validate_shared_by"  # how many configs of the job validated beside one dense side
    on_figures, off_figures = ({k: v for k, v in agreed(r["metrics"]).items() if k != shared}
                               for r in (on, off))  # fmt: skip
    assert on_figures == off_figures  # all but each run's own CPU time and its group's size
    assert on["drift"] == off["drift"]
    assert on["failed"] == []


@pytest.mark.parametrize("name", OVERLAPPED)
def test_overlap_issues_the_same_collectives(validated, name):
    """Async collectives are counted as the blocking ones: the same count and bytes per op and
    purpose; only the DP gradient sum is cut in buckets (the same bytes, 8 all-reduces)."""
    on = {(op, purpose): (n, b) for op, purpose, n, b in validated[name]["comm"]}
    off = {(op, purpose): (n, b) for op, purpose, n, b in validated[OVERLAPPED[name]]["comm"]}
    if name.startswith("dp2"):
        assert on.pop(("all_reduce", "dp_grads")) == (8, off.pop(("all_reduce", "dp_grads"))[1])
    assert on == off


# --- train.fused_optimizer ------------------------------------------------------------------------


def test_the_fused_optimizer_runs_adamws_fused_kernel():
    """On every device tpbench accepts (cpu, cuda) torch has the fused AdamW; the switch takes it."""
    import torch
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpbench.config import RunConfig
    from tpbench.experiments.training import adamw

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.name())
            return func(*args, **(kwargs or {}))

    assert {"cpu", "cuda"} <= set(_get_fused_kernels_supported_devices())
    for fused in (False, True):
        cfg = RunConfig()
        cfg.train.fused_optimizer = fused
        layer = torch.nn.Linear(8, 8)
        layer(torch.randn(2, 8)).sum().backward()
        optimizer = adamw(cfg, layer.parameters(), 1e-3)
        with Ops() as ops:
            optimizer.step()
        assert ("aten::_fused_adamw_" in ops.names) is fused


@pytest.mark.parametrize(
    "name, off", [("tp_fused", "tp"), ("tp_sp_linear_vp_fused_mixed", "tp_sp_linear_vp_mixed")]
)
def test_the_fused_optimizer_validates_as_the_unfused_one(validated, name, off):
    """Equal to dense after its AdamW steps, as the same mode unfused; not bit-exact (the fused kernel
    rounds its update in another order): the drift stays within 2x of the unfused run's."""
    on, ref = validated[name], validated[off]
    assert on["failed"] == []
    assert on["metrics"]["passed"] == (0.0 if on["failed"] else 1.0)
    assert on["metrics"]["grad_max_abs"] == ref["metrics"]["grad_max_abs"]  # before any step
    for (step, value), (_, value_off) in zip(on["drift"], ref["drift"], strict=True):
        assert value <= 2 * value_off + 1e-7, step


# --- train.compile ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, eager", COMPILED.items())  # both named: -k NAME runs its eager twin too
def test_compiled_blocks_validate_and_issue_the_same_collectives(validated, name, eager):
    """Compiled whole (fullgraph: a graph break would fail the run), or with overlap between the
    linears, equal to dense, every collective counted as eager: the custom ops run the same counted
    collectives. Not bit-exact against eager (inductor fuses the elementwise ops and reorders their
    sums): within the same bounds. Under aot_eager (all but INDUCTOR) the same checks of the graphs."""
    on, off = validated[name], validated[eager]
    assert on["failed"] == []
    assert on["metrics"]["passed"] == (0.0 if on["failed"] else 1.0)
    assert on["metrics"]["compile_graphs"] >= 1 and on["metrics"]["compile_graph_breaks"] == 0
    assert on["comm"] == off["comm"]
