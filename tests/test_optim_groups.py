"""AdamW's weight-decay groups and lr schedule (tpbench.experiments.optim, issue 58 item 2): which
parameters decay, torchtitan's schedule at chosen steps, every engine and DP level validating with
both on (the dense model and its reference stepped with the same groups and schedule), a planted
fault on the sharded side failing, and not a byte more in memory.

The validation and memory configs run in test_parallel's world-2 torchrun job (tests/torchrun_checks.py
`WORLD2`); the rest runs in this process.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from beside import beside
from torchrun_checks import BUCKETS, TINY, WORLD2, per_config, run_config

from tpbench.experiments import optim
from tpbench.experiments.setup import build_dense
from tpbench.predict import theory

ON = [  # groups and schedule: 6 validate steps are 2 of warm-up, 1 stable, 3 of cosine decay
    "model.attention_bias=true",  # biases to leave undecayed
    "train.weight_decay=0.1",
    "train.no_decay=[norms,biases,embeddings]",
    "train.lr_scheduler.warmup_steps=2",
    "train.lr_scheduler.decay_ratio=0.5",
    "train.lr_scheduler.decay_type=cosine",
    "train.lr_scheduler.min_lr_factor=0.1",
]
DP2 = ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=2"]
ZERO1 = [*DP2, "parallel.dp_shard=optimizer", BUCKETS]
ENGINES = {  # every engine and DP level of a world of 2
    "ddp_dp2": DP2,
    "megatron_tp2_sp_vp": ["parallel.tp=2", "parallel.sp=true", "parallel.vp=true"],
    "megatron_tp2_untied": ["parallel.tp=2", "model.tie_word_embeddings=false"],
    "zero1_dp2": ZERO1,
    # fp32 masters under bf16 autocast (bf16 GEMMs as a GPU computes them: fast on this CPU)
    "zero1_dp2_mixed": [
        *ZERO1,
        "train.precision=mixed",
        "train.dtype=bfloat16",
        "launch.bf16_gemm=fp32_accumulate",
    ],
    "fsdp2_dp2": [*DP2, "parallel.dp_shard=full"],
    "dtensor_tp2": ["parallel.engine=dtensor", "parallel.tp=2"],  # DTensor shards beside plain tensors
}
PLANTED = {  # the sharded side's AdamW broken: each must fail the optimizer check
    "zero1_dp2_decay_norm": [*ZERO1, "debug.optim_fault=decay_norm"],
    "megatron_tp2_decay_norm": [*ENGINES["megatron_tp2_sp_vp"], "debug.optim_fault=decay_norm"],
    "fsdp2_dp2_lr_ahead": [*ENGINES["fsdp2_dp2"], "debug.optim_fault=lr_ahead"],
    "dtensor_tp2_lr_ahead": [*ENGINES["dtensor_tp2"], "debug.optim_fault=lr_ahead"],
}
EAGER = ["train.compile=false"]
WORLD2.add("validate", "optim_groups", {k: [*TINY, *ON, *EAGER, *v] for k, v in (ENGINES | PLANTED).items()})

# Memory with the groups and schedule on, against the memory model (which knows neither): ZeRO-1 at
# the default tiny shape in mixed precision at S 8 peaks in its AdamW step (4 buckets of 40,000
# elements: its pieces' temporaries over the forward's; at S 32 the loss's forward is the peak since
# the reduce-scatters write the grad buffer in place, no [P/DP] output of their own), beside DDP
SMALL = ["kind=memory", "train.steps=1", "train.warmup=1", "train.compile=false", *ON]
ZERO1_S8 = [*DP2, "parallel.dp_shard=optimizer", "parallel.zero_bucket_elements=40000", "train.seq_len=8"]
MEMORY = {
    "zero1_dp2_mixed": [*SMALL, *ZERO1_S8, "train.precision=mixed", "train.dtype=bfloat16"],
    "zero1_dp2_fp32": [*SMALL, *ZERO1],
    "ddp_dp2": [*SMALL, *DP2],
}
# torch's AdamW on the CPU steps one tensor at a time, group after group: its temporaries are a
# tensor's two beside the one before it in its group. At S 4 the AdamW step is the peak, and with the
# groups the untied LM head follows the last down_proj (not the final norm): I x H x 4 - H x 4 =
# 65,280 B over the memory model, which takes the module's order (measured: 4,663,168 B with the
# groups, 4,597,890 without, the model's figure)
GROUPS_ORDER = {"ddp_dp2_untied_s4": [*SMALL, *DP2, "train.seq_len=4", "model.tie_word_embeddings=false",
                                      "model.vocab_size=1024", "train.no_decay=[norms,biases]"]}  # fmt: skip
WORLD2.add("memory", "optim_groups", GROUPS_ORDER)
WORLD2.add("memory", "optim_groups", MEMORY)


@beside
def validated(folder: Path) -> dict:
    return {
        name: each[0] for name, each in per_config(WORLD2.part(folder, "validate", "optim_groups")).items()
    }


@beside
def measured(folder: Path) -> dict:
    return per_config(WORLD2.part(folder, "memory", "optim_groups"))


# --- in this process ------------------------------------------------------------------------------


def test_groups_leave_norms_biases_and_embeddings_undecayed_by_name():
    cfg = run_config([*ON, "model.tie_word_embeddings=false"])
    names = [n for n, _ in build_dense(cfg).named_parameters()]
    kinds = {n: optim.kind_of(n) for n in names}
    norms = [n for n in names if n.split(".")[-2] in ("input_layernorm", "post_attention_layernorm",
                                                      "q_norm", "k_norm", "norm")]  # fmt: skip
    assert sorted(n for n, k in kinds.items() if k == "norms") == sorted(norms)
    assert len(norms) == 2 * 4 + 1  # per layer: two layer norms, q and k norms; the final norm
    assert sorted(n for n, k in kinds.items() if k == "biases") == sorted(
        n for n in names if n.endswith("bias")
    )
    assert [n for n, k in kinds.items() if k == "embeddings"] == ["model.embed_tokens.weight"]
    assert kinds["lm_head.weight"] == "weights"  # an untied head decays, as Megatron's output layer
    decayed = {n for n in names if optim.decays(n, cfg.train)}
    assert decayed == {n for n, k in kinds.items() if k == "weights"}
    only_norms = dataclasses.replace(cfg.train, no_decay=["norms"])
    assert {n for n in names if not optim.decays(n, only_norms)} == set(norms)
    assert optim.decays("model.norm.weight", cfg.train, fault="decay_norm")


def test_param_groups_carry_each_groups_decay_and_split_dtensors():
    cfg = run_config(ON)
    named = list(build_dense(cfg).named_parameters())
    groups = optim.param_groups(named, cfg.train)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(named)
    none = optim.param_groups(named, dataclasses.replace(cfg.train, weight_decay=0.0))
    assert len(none) == 1 and none[0]["weight_decay"] == 0.0  # nothing to tell apart
    as_before = optim.adamw(run_config([]), [p for _, p in named], 1e-3)
    assert len(as_before.param_groups) == 1  # the default: one group, as every run was built


def torchtitan(step: int, warmup: int, stable: int, decay: int, kind: str, floor: float) -> float:
    """torchtitan's linear_warmup_stable_decay (torchtitan/components/lr_scheduler.py at 0e13811),
    written out again here for the comparison."""
    step = min(step, warmup + stable + decay)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step < warmup + stable or decay == 0:
        return 1.0
    progress = (step + 1 - warmup - stable) / (decay + 1)
    left = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
            "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[kind]  # fmt: skip
    return floor + (1 - floor) * left


@pytest.mark.parametrize("kind", ["linear", "sqrt", "cosine"])
def test_schedule_is_torchtitans_at_chosen_steps(kind):
    cfg = run_config([*ON, f"train.lr_scheduler.decay_type={kind}"])
    horizon = 10  # warm-up 2, decay round(10 x 0.5) = 5, stable 3
    for step in (0, 1, 2, 4, 5, 7, 9, 10, 20):
        assert optim.lr_factor(step, cfg.train, horizon) == torchtitan(step, 2, 3, 5, kind, 0.1)
    assert optim.lr_factor(0, cfg.train, horizon) == pytest.approx(1 / 3)
    assert optim.lr_factor(9, cfg.train, horizon) > 0.1 == optim.lr_factor(10, cfg.train, horizon)
    every = dataclasses.replace(cfg.train.lr_scheduler, decay_ratio=None)  # torchtitan's default
    train = dataclasses.replace(cfg.train, lr_scheduler=every)
    assert [optim.lr_factor(s, train, horizon) for s in range(10)] == [
        torchtitan(s, 2, 0, 8, kind, 0.1) for s in range(10)
    ]


def test_the_schedule_steps_after_every_optimizer_step_in_training():
    """A training step runs at lr x factor(step) (horizon train.warmup + train.steps), ZeRO-1's AdamW of
    its shard as torch's; the defaults build no scheduler, the lr constant."""
    from tpbench.experiments.training import Trainer
    from tpbench.parallel import emulation

    for level in ("none", "optimizer"):
        cfg = run_config([*ON, "parallel.tp=1", "train.warmup=2", "train.steps=3",
                          f"parallel.dp_shard={level}", "train.compile=false"])  # fmt: skip
        emulation.init_process_group(cfg)
        try:
            trainer = Trainer(cfg)
            adamw = getattr(trainer.optimizer, "adamw", trainer.optimizer)
            lrs = []
            for _ in range(3):
                lrs.append(adamw.param_groups[0]["lr"])
                trainer.step()
            assert lrs == [cfg.train.lr * optim.lr_factor(s, cfg.train, 5) for s in range(3)]
            assert Trainer(run_config(["parallel.tp=1"])).scheduler is None
        finally:
            dist.destroy_process_group()


def test_a_zero1_piece_holds_decayed_and_undecayed_parts():
    """ZeRO-1's buckets hold the parameters in reverse order, whatever their group: at DP 2 some
    rank's piece of some bucket holds decayed and undecayed elements, which its decayed spans
    (zero.DistributedOptimizer.decayed) tell apart."""
    from tpbench.parallel.zero_buckets import plan_buckets

    cfg = run_config([*TINY, *ON, *ZERO1])
    named = dict((n, p.numel()) for n, p in build_dense(cfg).named_parameters())
    mixed = 0
    for bucket in plan_buckets(named, {"model.embed_tokens.weight"}, 20000, 2):
        half, offset, kinds = bucket.start + bucket.numel // 2, bucket.start, [set(), set()]
        for name in bucket.names:
            for rank, (lo, hi) in enumerate([(bucket.start, half), (half, bucket.start + bucket.numel)]):
                if offset < hi and offset + named[name] > lo:
                    kinds[rank].add(optim.decays(name, cfg.train))
            offset += named[name]
        mixed += sum(k == {True, False} for k in kinds)
    assert mixed > 0


def test_a_bad_group_or_schedule_is_refused_in_one_line():
    from tpbench.config import ConfigError
    from tpbench.parallel.checks import check_optimizer

    for bad in ("train.no_decay=[norm]", "train.lr_scheduler.decay_type=step",
                "train.lr_scheduler.decay_ratio=1.5", "debug.optim_fault=nope"):  # fmt: skip
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[-1]):
            check_optimizer(run_config([bad]))


@pytest.mark.parametrize(
    "overrides, accepted",
    [
        (["debug.optim_fault=decay_norm"], "train.weight_decay > 0 and norms in train.no_decay"),
        (["debug.optim_fault=decay_norm", "train.weight_decay=0.1"], "norms in train.no_decay"),
        (["debug.optim_fault=lr_ahead"], "warmup_steps > 0 or decay_ratio != 0"),
    ],
)
def test_an_optimizer_fault_that_would_change_nothing_is_refused_in_one_line(overrides, accepted):
    """decay_norm without weight decay or with the norms decayed anyway, lr_ahead with a constant lr:
    the sharded side's AdamW would be the dense side's, a planted bug that plants nothing (the
    validation grid's optimizer faults passed so until 2026-12-07). Refused before launch; with ON's
    groups and schedule each is accepted."""
    from tpbench.config import ConfigError
    from tpbench.parallel.checks import check_optimizer

    with pytest.raises(ConfigError, match=re.escape(accepted)) as e:
        check_optimizer(run_config(overrides))
    assert "\n" not in str(e.value) and str(e.value).startswith(overrides[0])
    check_optimizer(run_config([*ON, overrides[0]]))


def test_fit_and_the_report_say_the_groups_and_schedule():
    from tpbench.report.labels import optimizer_setting
    from tpbench.sizing.defaults import assumed

    cfg = run_config(ON)
    said = "no decay on norms+biases+embeddings · warm-up 2, cosine decay over 0.5 of the steps to 0.1"
    assert assumed(cfg, searched=True).endswith(f", {said}")  # fit's line; plan's has it too
    assert "decay" not in assumed(run_config([]))  # the defaults say nothing new
    schedule = dataclasses.asdict(cfg.train.lr_scheduler)
    flat = {"train.weight_decay": 0.1, "train.no_decay": ["norms", "biases", "embeddings"],
            **{f"train.lr_scheduler.{k}": v for k, v in schedule.items()}}  # fmt: skip
    assert optimizer_setting(flat) == said
    assert optimizer_setting({}) == ""  # a run recorded before the groups


def test_the_report_tells_a_run_with_groups_and_schedule_apart(tmp_path):
    """A run of the same shape with the groups and schedule is a setting of its own (tpbench.report.data)."""
    from test_db import config, outcome

    from tpbench.db import ResultsDB
    from tpbench.report.data import Selection, load

    db = ResultsDB(f"sqlite:///{tmp_path}/runs.db")
    grouped = config()
    grouped.train = dataclasses.replace(grouped.train, **{k: v for k, v in _train(run_config(ON)).items()})
    db.record(config(), outcome())
    db.record(grouped, outcome())
    settings = list(load(db, Selection()).runs.sort_values("id")["setting"])
    assert not settings[0].endswith("cosine decay over 0.5 of the steps to 0.1")
    assert (
        settings[1]
        == settings[0]
        + " · no decay on norms+biases+embeddings · warm-up 2, cosine decay over 0.5 of the steps to 0.1"
    )


def _train(cfg) -> dict:
    t = cfg.train
    return {"weight_decay": t.weight_decay, "no_decay": t.no_decay, "lr_scheduler": t.lr_scheduler}


# --- the world-2 job -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ENGINES)
def test_every_engine_and_level_validates_with_groups_and_schedule(validated, name):
    run = validated[name]
    assert run["failed"] == []
    assert run["metrics"]["passed"] == 1.0
    assert run["metrics"]["optimizer_update_of_bound"] <= 1.0  # bitwise where it is bitwise


@pytest.mark.parametrize("name", PLANTED)
def test_a_planted_decay_or_lr_on_the_sharded_side_fails(validated, name):
    run = validated[name]
    assert run["metrics"]["passed"] == 0.0
    failed = [line for line in run["failed"] if line.startswith("optimizer_update")]
    assert failed, run["failed"]
    if name.endswith("decay_norm"):  # only the norm the fault decays
        assert failed[0].startswith("optimizer_update model.norm.weight")


@pytest.mark.parametrize("name", MEMORY)
def test_groups_and_schedule_hold_not_a_byte_more(measured, name):
    """Every rank's peak is the memory model's, which knows no groups nor schedule: ZeRO-1 decays its
    shard's decayed part in place, AdamW's state is as large, the schedule holds floats."""
    predicted = theory.predict(run_config(MEMORY[name])).peak_bytes
    assert [rank["peak"] for rank in measured[name]] == [predicted] * 2


def test_torch_adamw_groups_reorder_its_cpu_temporaries(measured):
    """Where torch AdamW's step is the peak on the CPU, its groups change which tensor a temporary sits
    beside (GROUPS_ORDER: the untied head after the last down_proj, not the final norm), as the model's
    AdamW temporaries take them (tpbench.predict.theory.weights.adam_groups); in the module's order the
    model was 65,280 B under the measured peak."""
    name = "ddp_dp2_untied_s4"
    predicted = theory.predict(run_config(GROUPS_ORDER[name])).peak_bytes
    assert [rank["peak"] for rank in measured[name]] == [predicted] * 2


def test_zero1_mixed_peaks_in_its_adamw_step(measured):
    """Where the groups act: the peak moment is the optimizer step's."""
    assert all("optimizer" in str(rank["peak_at"]) for rank in measured["zero1_dp2_mixed"])


def test_an_emulated_rank_decays_no_undecayed_parameter():
    """ZeRO-1 at DP 1 (one rank, all of the shard): after a step from zero gradients, a decayed
    weight shrank by exactly 1 - lr x wd, an undecayed norm did not move."""
    from tpbench.experiments.training import Trainer
    from tpbench.parallel import emulation

    cfg = run_config([*ON, "parallel.tp=1", "parallel.dp_shard=optimizer", "train.compile=false"])
    emulation.init_process_group(cfg)
    try:
        trainer = Trainer(cfg)
        zero = trainer.optimizer
        before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
        zero.grad_buffer.zero_()  # the gradient pieces AdamW steps: zeros
        lr = zero.adamw.param_groups[0]["lr"]
        zero.step()
        after = dict(trainer.module.named_parameters())
        shrunk = before["model.layers.0.mlp.up_proj.weight"] * (1 - lr * 0.1)
        assert torch.equal(after["model.layers.0.mlp.up_proj.weight"], shrunk)
        assert torch.equal(after["model.norm.weight"], before["model.norm.weight"])
        assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    finally:
        dist.destroy_process_group()
