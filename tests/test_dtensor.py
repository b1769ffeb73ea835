"""The DTensor engine (torch.distributed.tensor.parallel) against dense and against ours.

Every case runs in test_parallel's world-2 torchrun job over gloo (tests/torchrun_checks.py `WORLD2`:
its validate suite, and `comm_per_step` for each engine's collectives), and its world-8 job for the
DTensor engine's TP under HSDP; the assertions live here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from beside import beside
from torchrun_checks import (
    BREAKS,
    TINY,
    TOL_FWD,
    TOL_GRAD,
    TOL_PARAM,
    WORLD2,
    WORLD4,
    WORLD8,
    B,
    H,
    L,
    S,
    peaks_told,
    per_config,
    run_config,
    same_on_every_rank,
)
from torchrun_checks import FAMILIES as PARALLEL_FAMILIES

from tpbench.experiments.criterion import CHECKS as VALIDATE_CHECKS
from tpbench.experiments.criterion import K
from tpbench.predict import theory

F32 = 4  # bytes

MODES = {
    "dtensor_tp": ["parallel.tp=2"],
    "dtensor_tp_sp": ["parallel.tp=2", "parallel.sp=true"],
    "dtensor_tp_vp": ["parallel.tp=2", "parallel.vp=true"],
    "dtensor_tp_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
}
PRECISIONS = {
    "bf16": ["train.dtype=bfloat16"],
    "mixed": ["train.dtype=bfloat16", "train.precision=mixed"],
}
IN_PRECISION = {f"{m}_{p}": [*o, *PRECISIONS[p]] for m, o in MODES.items() for p in PRECISIONS}
# the families (tests/test_parallel.py FAMILIES): no q/k norms to place (Llama, Qwen2.5), q/k/v biases
# cut with their weights by ColwiseParallel (Qwen2.5), head_dim 16 != H / heads (Qwen2.5, Qwen3)
FAMILIES = {
    f"dtensor_{family}_{mode}": [*overrides, *MODES[f"dtensor_{mode}"]]
    for family, overrides in PARALLEL_FAMILIES.items()
    for mode in ("tp", "tp_sp_vp")
}
BROKEN = {  # each gradient sum switched off: validation must fail
    "broken_qk_norm": ["parallel.tp=2", "debug.skip_grad_sum=[qk_norm]"],
    "broken_sp_norms": ["parallel.tp=2", "parallel.sp=true", "debug.skip_grad_sum=[sp_norms]"],
    "broken_qk_norm_bf16": ["parallel.tp=2", "train.dtype=bfloat16", "debug.skip_grad_sum=[qk_norm]"],
}


# --- the torchrun job: test_parallel's world-2 job (tests/torchrun_checks.py WORLD2) ----------------

WORLD2.add(
    "validate",
    "dtensor",  # validate.run on the DTensor engine (debug.skip_grad_sum reaches parallelize_dtensor)
    {
        name: [*TINY, "parallel.engine=dtensor", *o]
        for name, o in (MODES | IN_PRECISION | FAMILIES | BROKEN).items()
    },
)
WORLD2.add("comm_per_step", "dtensor", {name: [*TINY, *o] for name, o in MODES.items()})

# TP 2 x HSDP (replicate 2 x shard 2): FSDP2 over the (dp_replicate, dp_shard) dims of the mesh whose tp
# dim holds the TP shards, one (dp_replicate, dp_shard, tp) mesh (tpbench.parallel.context). 8 ranks,
# the fewest with every dim real, share the 2 cores: two AdamW steps, as test_parallel's T 8 cases
HSDP8 = ["parallel.engine=dtensor", "parallel.tp=2", "parallel.dp=4", "parallel.dp_replicate=2"]
HSDP = {
    "hsdp_full": [*HSDP8, "parallel.dp_shard=full"],
    "hsdp_grads_sp_vp_mixed": [
        *HSDP8,
        "parallel.dp_shard=grads",
        "parallel.sp=true",
        "parallel.vp=true",
        *PRECISIONS["mixed"],
    ],  # fmt: skip
    "broken_hsdp_full_reduce_scatter": [
        *HSDP8,
        "parallel.dp_shard=full",
        "debug.shard_fault=no_reduce_scatter",
    ],
}
WORLD8.add(
    "validate", "dtensor", {k: [*TINY, "validate.steps=2", "validate.every=1", *o] for k, o in HSDP.items()}
)


# DTensor's own memory (tpbench.predict.theory: Dims.dtensor), every rank's peak against the model in
# test_parallel's world-4 job (test_theory's SMALL: H 64, L 2, V 512, S 64, bf16). Each config peaks at
# a term of DTensor's own: SP's gathered inputs kept, each column linear's own cast (mixed), loss_parallel's
# forward and backward, its whole-vocab embedding gradient (S 4) and finish_grads' slice of it, AdamW's
# plain tensors grouped apart, FSDP2 (+2,048 B at da73337: CommDebugMode's backward hooks held the RoPE
# tables twice in the counted step)
MEMORY_SMALL = ["kind=memory", "model.hidden_size=64", "model.num_hidden_layers=2", "model.vocab_size=512",
                "train.seq_len=64", "train.dtype=bfloat16", "train.steps=1", "train.warmup=1",
                "parallel.engine=dtensor"]  # fmt: skip
DP2 = ["parallel.tp=2", "parallel.dp=2"]
SP, VP, MIXED = "parallel.sp=true", "parallel.vp=true", "train.precision=mixed"
UNTIED_S4 = ["train.seq_len=4", "model.tie_word_embeddings=false"]
MEMORY = {
    "dp2_dtensor_tp_sp": [*DP2, SP],
    "t4_dtensor_tp_mixed": ["parallel.tp=4", MIXED],
    "dp2_dtensor_tp_vp_fp32": [*DP2, VP, "train.dtype=float32"],
    "t4_dtensor_tp_sp_vp_mixed": ["parallel.tp=4", SP, VP, MIXED],
    "t4_dtensor_tp_vp_s4": ["parallel.tp=4", VP, "train.seq_len=4"],
    "t4_dtensor_tp_sp_vp_untied_s4": ["parallel.tp=4", SP, VP, *UNTIED_S4],
    "dp2_dtensor_tp_untied_s4": [*DP2, *UNTIED_S4],
    "dp2_full_dtensor_tp": [*DP2, "parallel.dp_shard=full"],
    "dp2_grads_dtensor_tp_sp_vp_fp32": [
        *DP2,
        SP,
        VP,
        "parallel.dp_shard=grads",
        "train.dtype=float32",
        "model.vocab_size=256",
        "train.seq_len=32",
    ],  # its loss forward
    # recompute on DTensor's engine: op's policy keeps its reduce-scatters and recomputes its
    # all-gathers and all-reduces (none of the gathered inputs kept, unlike ours); full and selective
    # hold its SP's gathered inputs as its forward does (no re-gather)
    "dp2_dtensor_tp_sp_vp_op": [*DP2, SP, VP, "train.recompute=op"],
    "t4_dtensor_tp_op_mixed": ["parallel.tp=4", MIXED, "train.recompute=op"],
    "dp2_full_dtensor_tp_sp_op": [*DP2, SP, "parallel.dp_shard=full", "train.recompute=op"],
    "t4_dtensor_tp_sp_full": ["parallel.tp=4", SP, "train.recompute=full"],
    "dp2_dtensor_tp_vp_selective_mixed": [*DP2, VP, MIXED, "train.recompute=selective"],
    # manual attention (its softmax in forward the peak, S 256), without and with op's policy
    "t4_dtensor_tp_vp_fp32_manual": [
        "parallel.tp=4",
        VP,
        "train.dtype=float32",
        "model.flash_attn=false",
        "train.seq_len=256",
    ],
    "dp2_dtensor_tp_op_fp32_manual": [
        *DP2,
        "train.recompute=op",
        "train.dtype=float32",
        "model.flash_attn=false",
        "train.seq_len=256",
    ],
    "dp2_dtensor_tp_sp_op_fp32_manual": [
        *DP2,
        SP,
        "train.recompute=op",
        "train.dtype=float32",
        "model.flash_attn=false",
        "train.seq_len=256",
    ],
}
# T 2 alone (test_parallel's world-2 job): AdamW's plain tensors (the norms) a group after the
# DTensors, its loop's previous tensor a down_proj shard where ours has a norm weight: the optimizer
MEMORY2 = {"t2_dtensor_tp_vp_untied_s4_fp32": ["parallel.tp=2", VP, *UNTIED_S4, "train.dtype=float32"]}
WORLD4.add("memory", "dtensor", {name: [*MEMORY_SMALL, *o] for name, o in MEMORY.items()})
WORLD2.add("memory", "dtensor", {name: [*MEMORY_SMALL, *o] for name, o in MEMORY2.items()})
MEMORY |= MEMORY2


@beside
def memory(folder: Path) -> dict:
    """Per config, every rank's measured peak (test_parallel's world-4 and world-2 jobs)."""
    four, two = (w.part(folder, "memory", "dtensor") for w in (WORLD4, WORLD2))
    return per_config(four) | per_config(two)


@pytest.mark.parametrize("name", MEMORY)
def test_dtensor_peak_memory_is_predicted_to_the_byte(memory, name):
    """Every rank's peak and its split by MemTracker's categories, to the byte, with DTensor's own
    terms (tpbench.predict.theory, Dims.dtensor)."""
    predicted = theory.predict(run_config([*MEMORY_SMALL, *MEMORY[name]]))
    ranks = memory[name]
    assert [rank["late_frees"] for rank in ranks] == [0] * len(ranks), peaks_told(ranks)
    assert [rank["peak"] for rank in ranks] == [predicted.peak_bytes] * len(ranks), peaks_told(ranks)
    for rank in ranks:
        assert {
            k: v for k, v in rank["breakdown"].items() if k in predicted.breakdown()
        } == predicted.breakdown()


@pytest.mark.parametrize(
    "name", [n for n in MEMORY if n not in ("dp2_full_dtensor_tp", "t4_dtensor_tp_sp_full")]
)
def test_dtensor_memory_is_not_ours(memory, name):
    """Each config but FSDP2's (whose +2,048 B was the measurement's, not DTensor's) and full
    recompute's (both engines keep a block's input alone, and hold the same recomputed block: its peak
    is ours to the byte) holds what tpbench's engine would not, in its peak or its split: the model
    without DTensor's terms, as it predicted before them (the same config on tpbench's engine), fails
    the test above."""
    ours = theory.predict(run_config([o for o in [*MEMORY_SMALL, *MEMORY[name]] if "engine" not in o]))
    rank = memory[name][0]
    split = {k: v for k, v in rank["breakdown"].items() if k in ours.breakdown()}
    assert (rank["peak"], split) != (ours.peak_bytes, ours.breakdown())


def test_the_dtensor_peaks_fall_at_its_own_moments():
    """As test_theory's: the configs above peak at each of DTensor's own moments (its loss's forward
    under ZeRO-2, its backward; the whole-vocab embedding gradient under VP, tied and untied; its DP
    sum's flat copy made after backward; AdamW with the norms grouped apart; manual attention under
    op: the top block's softmax in forward, the policy's outputs of the block below kept)."""
    names = {theory.predict(run_config([*MEMORY_SMALL, *o])).peak.name for o in MEMORY.values()}
    assert names == {"loss", "loss backward", "backward end", "embedding gradient slice", "gradient sums",
                     "optimizer", "attention forward"}  # fmt: skip


@beside
def measured(folder: Path) -> dict:
    """Per case, rank 0's figures and each engine's collectives of a step, once rank 1 reported the same
    (each figure is the worst over the job)."""
    ranks = WORLD2.part(folder, "validate", "dtensor")
    metrics = same_on_every_rank([{name: r["metrics"] for name, r in rank.items()} for rank in ranks])
    comm = same_on_every_rank(WORLD2.part(folder, "comm_per_step", "dtensor"))
    failed = {name: r["failed"] for name, r in ranks[0].items()}  # validate names them on rank 0
    rows = {name: r["params"] for name, r in ranks[0].items()}  # rank 0's rows, as the database has them
    return {
        name: {"metrics": m, "failed": failed[name], "params": rows[name], **comm.get(name, {})}
        for name, m in metrics.items()
    }


@beside
def hsdp(folder: Path) -> dict:
    """Per case, rank 0's figures and failed checks, once every rank reported the same figures."""
    ranks = WORLD8.part(folder, "validate", "dtensor")
    same_on_every_rank(
        [{n: {"metrics": r["metrics"], "comm": r["comm"]} for n, r in rank.items()} for rank in ranks]
    )
    return ranks[0]


@pytest.mark.parametrize("mode", [*MODES, *FAMILIES])
def test_every_dtensor_mode_equals_dense(measured, mode):
    m = measured[mode]["metrics"]
    assert m["fwd_logits_max_abs"] <= TOL_FWD
    assert m["loss_abs_diff"] <= TOL_FWD
    assert m["grad_max_rel_l2"] <= TOL_GRAD
    assert m["adamw_param_max_abs"] <= TOL_PARAM
    assert m["passed"] == 1.0


@pytest.mark.parametrize("case", IN_PRECISION)
def test_every_dtensor_mode_equals_dense_in_bf16_and_mixed(measured, case):
    m = measured[case]["metrics"]
    assert m["fwd_logits_max_abs"] > 100 * TOL_FWD  # bf16 rounding: fp32's tolerance would fail it
    failed = measured[case]["failed"]
    for check, *_, free in VALIDATE_CHECKS:  # each one's worst item within K x its reference + floor
        if not free:  # the free-running checks are reported without a verdict in bf16 and mixed
            assert m[f"{check}_of_bound"] <= 1, check
    assert failed == []
    assert m["passed"] == (0.0 if failed else 1.0)


@pytest.mark.parametrize("case", BROKEN)
def test_each_norm_gradient_sum_is_needed(measured, case):
    m = measured[case]["metrics"]
    assert m["grad_max_rel_l2"] > 0.1  # local partial sums, not the dense gradient
    assert m["grad_max_rel_l2"] > K * m["dense_grad_max_rel_l2"]
    assert m["passed"] == 0.0
    if case == "broken_qk_norm":  # fp32: nothing sums them: the replicas drift apart under AdamW
        assert m["adamw_param_max_abs"] > TOL_PARAM


@pytest.mark.parametrize("case", BROKEN)
def test_a_skipped_norm_sum_fails_exactly_the_gradients_that_need_it(measured, case):
    """As tests/test_parallel.py's on our engine: the parameters the skipped sum leaves partial fail
    their own bound, one is named the worst, every other passes."""
    (breaking,) = [BREAKS[o] for o in BROKEN[case] if o in BREAKS]
    breaks, rows = re.compile(breaking), measured[case]["params"]
    failing = {n for n, (error, reference) in rows.items() if error > K * reference + TOL_GRAD}
    assert failing == {n for n in rows if breaks.search(n)} and failing
    (line,) = [f for f in measured[case]["failed"] if f.startswith("grad_rel_l2 ")]
    assert breaks.search(line.split()[1]), line


@pytest.mark.parametrize("case", [c for c in HSDP if not c.startswith("broken")])
def test_dtensor_tp_under_hsdp_equals_dense(hsdp, case):
    """fp32 to the core tolerances; bf16 compute within each check's bound. FSDP2 all-reduces each
    unit's reduce-scattered gradients across the 2 replicas: 2 blocks and the root."""
    m, failed = hsdp[case]["metrics"], hsdp[case]["failed"]
    if case == "hsdp_full":
        assert m["fwd_logits_max_abs"] <= TOL_FWD and m["grad_max_rel_l2"] <= TOL_GRAD
        assert m["adamw_param_max_abs"] <= TOL_PARAM
    assert failed == [] and m["passed"] == 1.0
    counted = {(op, purpose): count for op, purpose, count, _ in hsdp[case]["comm"]}
    assert counted[("all_reduce", "dp_grads")] == counted[("reduce_scatter", "dp_grads")] == 3


def test_dtensor_tp_under_hsdp_fails_with_its_reduce_scatter_broken(hsdp):
    m, failed = (
        hsdp["broken_hsdp_full_reduce_scatter"]["metrics"],
        hsdp["broken_hsdp_full_reduce_scatter"]["failed"],
    )
    assert m["passed"] == 0.0 and m["grad_max_rel_l2"] > 0.1
    assert any(f.startswith("grad_rel_l2 ") for f in failed)


def test_tp_all_reduces_twice_per_block_each_way(measured):
    act = S * B * H * F32  # one [S, B, H] fp32 tensor; ring all-reduce at T=2 moves 2(T-1)/T = 1x
    assert measured["dtensor_tp"]["comm_dtensor"]["all_reduce/activation"] == [4 * L, 4 * L * act]


def test_sp_gathers_and_scatters_instead(measured):
    act = S * B * H * F32 // 2  # all-gather / reduce-scatter at T=2 move (T-1)/T = 1/2
    comm = measured["dtensor_tp_sp"]["comm_dtensor"]
    assert comm["reduce_scatter/activation"] == [4 * L, 4 * L * act]
    # + embedding backward (Shard -> Replicate) and the LM head's entry forward
    assert comm["all_gather/activation"] == [4 * L + 2, (4 * L + 2) * act]
    assert "all_reduce/activation" not in comm


def test_vp_loss_is_three_all_reduces_of_s_b(measured):
    comm = measured["dtensor_tp_sp_vp"]["comm_dtensor"]
    assert comm["all_reduce/loss"] == [3, 3 * S * B * F32]


@pytest.mark.parametrize("mode", MODES)
def test_dtensor_moves_the_same_bytes_as_ours(measured, mode):
    """Same activation and loss traffic; ours adds the SP re-gather in backward (less memory), and
    packs its norm gradient sums into one all-reduce where DTensor sends one per weight."""
    ours, theirs = measured[mode]["comm_ours"], measured[mode]["comm_dtensor"]
    for key in ("all_reduce/activation", "all_gather/activation", "reduce_scatter/activation"):
        assert theirs.get(key) == ours.get(key), key
    assert theirs.get("all_reduce/loss") == ours.get("all_reduce/loss")
    assert theirs["all_reduce/grad_sum"][1] == ours["all_reduce/grad_sum"][1]


def test_what_dtensor_cannot_express_is_refused_up_front():
    from tpbench.config import ConfigError, ModelConfig, ParallelConfig
    from tpbench.parallel.checks import check_dtensor_shardable

    tiny = ModelConfig()  # heads 8/4, V 256
    check_dtensor_shardable(tiny, ParallelConfig(tp=4, sp=True, vp=True, engine="dtensor"))
    with pytest.raises(ConfigError, match="num_key_value_heads=4, parallel.tp=8"):
        check_dtensor_shardable(tiny, ParallelConfig(tp=8, engine="dtensor"))
    check_dtensor_shardable(tiny, ParallelConfig(tp=8))  # ours replicates KV heads: not refused here
    odd_vocab = ModelConfig(vocab_size=255)
    check_dtensor_shardable(odd_vocab, ParallelConfig(tp=2, engine="dtensor"))  # replicated vocab: fine
    with pytest.raises(ConfigError, match="vocab_size=255"):
        check_dtensor_shardable(odd_vocab, ParallelConfig(tp=2, vp=True, engine="dtensor"))


@pytest.mark.parametrize("sp,vp", [(False, False), (True, False), (False, True), (True, True)])
def test_both_engines_read_one_module_table(sp, vp):
    """The DTensor plan is the plan's table (plan.tp_styles) made ParallelStyles, module for module:
    only SP with a replicated vocab puts the final norm's gather on the LM head's input."""
    from tpbench.parallel.dtensor import tp_plan
    from tpbench.parallel.plan import STYLES, tp_styles

    styles = tp_styles(2, sp, vp)
    assert set(styles.values()) <= set(STYLES)
    assert set(tp_plan(2, sp, vp)) == set(styles) | ({"lm_head"} if sp and not vp else set())
    assert "model.layers.1.mlp.down_proj" in styles and styles["model.layers.1.mlp"] == "entry"
