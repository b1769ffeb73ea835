"""Gradient accumulation (train.accumulation = K): a step of K micro-batches per DP rank, the losses
averaged as one batch K times as large, one DP gradient sync and one optimizer step.

The shared torchrun jobs (tests/torchrun_checks.py's WORLD2 and WORLD4) validate K = 2 against the
dense model on the whole K x DP x micro-batch (forward, loss, gradients, AdamW steps) at every
dp_shard level at DP 2 x TP 1 (mode=ddp: DDP's no_sync, ZeRO-1's one reduce-scatter, FSDP2's
reduce-scatter every micro-batch, torchtitan's choice), under TP at DP 2 x TP 2 and under HSDP (2
replicas of a shard group of 2, its all-reduce every micro-batch too); their counted collectives
equal the byte model's (tpbench.predict.theory.accumulation). The same checks with 20 AdamW steps, as
the results page ran them:

    tpbench sweep kind=validate accumulation=2 dp=2 mode=ddp dp_shard=none,optimizer,grads,full
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from beside import beside
from test_cli import nothing_written, workdir  # noqa: F401 (a fixture)
from torchrun_checks import BUCKETS, WORLD2, WORLD4, per_config, rank0_of_each, run_config
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.predict import theory
from tpbench.predict.theory import sharding

TINY = ["model.flash_attn=false", "validate.steps=3", "validate.every=3", "train.accumulation=2"]
DDP = ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=2"]
DP2_TP1 = {f"{level}_ddp": [*TINY, *DDP, f"parallel.dp_shard={level}", BUCKETS] for level in sharding.LEVELS}
DP2_TP2 = {
    "none_tp_vp": [*TINY, "parallel.tp=2", "parallel.dp=2", "parallel.vp=true"],
    "full_tp_sp_vp": [*TINY, "parallel.tp=2", "parallel.dp=2", "parallel.sp=true", "parallel.vp=true",
                      "parallel.dp_shard=full"],
    "hsdp_full_ddp": [*TINY, *DDP[:2], "parallel.dp=4", "parallel.dp_replicate=2", "parallel.dp_shard=full"],
}  # fmt: skip
# the DTensor engine: its second micro-batch's forward raised IndexError at da73337 (torch's
# CommDebugMode, which counted its collectives, registered a module's forward hook again at each forward)
DTENSOR = {
    "none_dtensor_tp_sp_vp": [*TINY, "parallel.engine=dtensor", "parallel.tp=2", "parallel.dp=2",
                              "parallel.sp=true", "parallel.vp=true"],
    "full_dtensor_tp": [*TINY, "parallel.engine=dtensor", "parallel.tp=2", "parallel.dp=2",
                        "parallel.dp_shard=full"],
}  # fmt: skip
DP2_TP2 |= DTENSOR

WORLD2.add("validate", "accumulation", DP2_TP1)
WORLD4.add("validate", "accumulation", DP2_TP2)
# the memory experiment at K 2, every rank's peak against the model (theory.accumulation.step_moments)
SMALL = ["kind=memory", "model.hidden_size=64", "model.num_hidden_layers=2", "model.vocab_size=512",
         "train.seq_len=64", "train.dtype=bfloat16", "train.steps=1", "train.warmup=1",
         "train.accumulation=2"]  # fmt: skip
MEMORY2 = {f"{lv}_tp1": [*SMALL, "parallel.tp=1", "parallel.dp=2", f"parallel.dp_shard={lv}", BUCKETS]
           for lv in sharding.LEVELS}  # fmt: skip
MEMORY2 |= {
    "ddp_tp1": [*SMALL, *DDP],
    "full_tp1_s4": [*MEMORY2["full_tp1"], "train.seq_len=4"],
    "grads_tp1_mixed": [*MEMORY2["grads_tp1"], "train.precision=mixed"],
}
MEMORY4 = {
    "none_tp2_vp": [*SMALL, "parallel.tp=2", "parallel.dp=2", "parallel.vp=true"],
    "optimizer_tp2": [*SMALL, "parallel.tp=2", "parallel.dp=2", "parallel.dp_shard=optimizer", BUCKETS],
    "full_tp2_sp_vp": [*SMALL, "parallel.tp=2", "parallel.dp=2", "parallel.dp_shard=full", "parallel.sp=true",
                       "parallel.vp=true"],
    "hsdp_full": [*SMALL, "parallel.tp=1", "parallel.dp=4", "parallel.dp_replicate=2",
                  "parallel.dp_shard=full"],
}  # fmt: skip
WORLD2.add("memory", "accumulation", MEMORY2)
WORLD4.add("memory", "accumulation", MEMORY4)


@beside
def accumulated(folder: Path) -> dict:
    two, four = (w.part(folder, "validate", "accumulation") for w in (WORLD2, WORLD4))
    return rank0_of_each(two) | rank0_of_each(four)


@beside
def measured(folder: Path) -> dict:
    two, four = (w.part(folder, "memory", "accumulation") for w in (WORLD2, WORLD4))
    return per_config(two) | per_config(four)


@pytest.mark.parametrize("name", [*MEMORY2, *MEMORY4])
def test_measured_peak_of_two_micro_batches_is_predicted_to_the_byte(measured, name):
    predicted = theory.predict(run_config(MEMORY2.get(name) or MEMORY4[name]))
    assert len(measured[name]) in (2, 4)
    assert [rank["peak"] for rank in measured[name]] == [predicted.peak_bytes] * len(measured[name])


@pytest.mark.parametrize("name", [*DP2_TP1, *DP2_TP2])
def test_k_micro_batches_match_dense_on_the_whole_batch(accumulated, name):
    r = accumulated[name]
    assert r["failed"] == [] and r["metrics"]["passed"] == 1.0


@pytest.mark.parametrize("name", [*DP2_TP1, *(n for n in DP2_TP2 if n not in DTENSOR)])
def test_counted_collectives_equal_the_model(accumulated, name):
    """DP's gradient sync (but FSDP2's) and the TP gradient sums once a step, TP's collectives and
    FSDP2's all-gathers and gradient sync (reduce-scatters; HSDP's all-reduce) once per micro-batch,
    as counted over the validation's first step (forward, backward and the gradient sums: ZeRO-1's
    all-gather, in the optimizer step, is after it). (The byte model counts tpbench's engine:
    DTensor's sums each norm's gradient on its own, and under FSDP2 in backward.)"""
    cfg = run_config(DP2_TP1.get(name) or DP2_TP2[name])
    rows = [r for r in theory.predict(cfg).comm_rows() if not (name.startswith("optimizer") and
                                                               r.purpose == sharding.PARAMS)]  # fmt: skip
    predicted = {(r.op, r.purpose): [r.count, r.bytes] for r in rows}
    counted = {(op, purpose): [count, size] for op, purpose, count, size in accumulated[name]["comm"]}
    assert counted == predicted
    grads = [c for (op, purpose), (c, _) in counted.items() if purpose == sharding.GRADS]
    assert grads and all(c == grads[0] for c in grads)


@pytest.fixture
def alone():
    """A process group of one rank (the fake backend: no collective runs), torn down after."""
    from tpbench.parallel import emulation

    def start(cfg):
        emulation.init_process_group(cfg)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_step_of_k_micro_batches_is_one_step_of_the_whole_batch(alone):
    """One rank: K = 2 micro-batches of 1 draw the tokens one micro-batch of 2 draws, and their step
    leaves the same mean loss and gradients (each micro-batch's loss divided by K)."""
    from tpbench.experiments.training import Trainer

    base = ["model.flash_attn=false", "parallel.tp=1", "parallel.dp=1", "train.seq_len=16"]
    results = []
    for k, b in ((1, 2), (2, 1)):
        cfg = run_config([*base, f"train.accumulation={k}", f"train.micro_batch={b}"])
        alone(cfg)
        try:
            trainer = Trainer(cfg)
            loss = trainer.step()
            results.append((loss, {n: p.grad.clone() for n, p in trainer.module.named_parameters()}))
        finally:
            dist.destroy_process_group()
    (loss_one, grads_one), (loss_k, grads_k) = results
    assert torch.allclose(loss_k, loss_one, rtol=1e-6)
    for name, g in grads_one.items():
        assert torch.allclose(grads_k[name], g, rtol=1e-4, atol=1e-7), name


REFUSED = {  # before launch: one line, exit 2
    "zero micro-batches": (
        ["kind=validate", "accumulation=0"],
        "train.accumulation=0: accepted are integers >= 1",
    ),
    "dropout": (
        ["kind=validate", "dp=2", "accumulation=2", "model.dropout=0.1", "model.flash_attn=false"],
        "train.accumulation=2 with model.dropout=0.1: the dropout masks",
    ),
    "megatron's overlapped DP buckets": (
        ["kind=validate", "dp=2", "accumulation=2", "overlap=true"],
        "train.accumulation=2 with parallel.overlap=true and parallel.dp=2",
    ),
}


@pytest.mark.parametrize("overrides, says", REFUSED.values(), ids=REFUSED.keys())
def test_accumulation_that_cannot_run_is_refused_in_one_line(workdir, overrides, says):  # noqa: F811
    done = CliRunner().invoke(app, ["run", *overrides])
    assert done.exit_code == 2, done.output
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    assert nothing_written(workdir)


def test_accumulation_at_its_default_keeps_the_run_id():
    from tpbench.config import RunConfig, config_hash

    cfg = RunConfig()
    k2 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, accumulation=2))
    assert config_hash(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, accumulation=1))) == (
        config_hash(cfg)
    )
    assert config_hash(k2) != config_hash(cfg)


def test_a_throughput_step_counts_the_tokens_and_flops_of_its_micro_batches(alone):
    """One rank, K = 2: the step's tokens are both micro-batches', and the FLOPs it executes (counted)
    are the model's FLOPs of both."""
    from tpbench.experiments import throughput

    cfg = run_config(["model.flash_attn=false", "parallel.tp=1", "parallel.dp=1", "train.seq_len=16",
                      "train.accumulation=2", "train.steps=1", "train.warmup=0"])  # fmt: skip
    alone(cfg)
    figures = {m.name: m.value for m in throughput.run(cfg).measurements}
    assert figures["tokens_per_step"] == 2 * cfg.train.micro_batch * 16
    assert (
        figures["flops_per_step"] == figures["model_flops_per_step"] == 2 * theory.model_flops_per_step(cfg)
    )


class AccumulatingTracker:
    """memory.PeakTracker that takes the root's forward again within a step (the next micro-batch) as
    a fresh start of its per-module statistics, which tpbench reads none of: MemTracker refuses a
    module's second call. (The memory experiment's own tracker does not yet: tpbench.predict.checked.)"""

    def __new__(cls):
        from tpbench.experiments.memory import PeakTracker

        class Tracker(PeakTracker):
            def _pre_fw_hook(self, module, inputs):
                outer = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
                if module in self.memory_tracking and not self._mod_tracker.is_bw and outer == {"Global"}:
                    self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        return Tracker()


# SMALL of tests/test_theory_sharded.py, K 2 micro-batches of 2 sequences
K2 = ["kind=memory", "model.hidden_size=64", "model.num_hidden_layers=2", "model.vocab_size=512",
      "train.seq_len=64", "train.dtype=bfloat16", "parallel.tp=1", "train.accumulation=2"]  # fmt: skip


@pytest.mark.parametrize(
    ("dp_shard", "D", "overrides"),
    [
        ("none", 1, []),  # every gradient of the first micro-batch held through the second's step
        ("none", 1, ["train.precision=mixed", "train.recompute=full"]),
        ("grads", 2, []),  # every unit's shard held, each reduce-scatter's output added into it
        ("full", 2, []),
        ("full", 4, ["model.flash_attn=false", "train.seq_len=256"]),
        # few tokens: a higher block's input norm backward, the lower blocks' saved tensors beside
        # every shard (the top block's at L 2, block 1's at L 3, block 2's at L 4 under full recompute)
        ("full", 2, ["train.seq_len=4"]),
        ("full", 4, ["train.seq_len=4", "model.num_hidden_layers=3"]),
        ("full", 2, ["train.seq_len=4", "model.num_hidden_layers=4", "train.recompute=full"]),
    ],
)
def test_a_step_of_two_micro_batches_peaks_as_the_model_says(alone, dp_shard, D, overrides):
    """tpbench's Trainer on rank 0 of a fake group (FSDP2 as test_theory_sharded's stand-in: torch's
    fully_shard per block and the root, its gradients synced every micro-batch), the second of two
    steps of K 2 measured: its peak equals the model's (theory.accumulation.step_moments), and is the
    one-micro-batch step's peak plus what the first micro-batch leaves."""
    import gc

    from torch.distributed.fsdp import fully_shard

    from tpbench.experiments.training import Trainer, adamw

    cfg = run_config([*K2, *overrides, f"parallel.dp={D}", "debug.skip_grad_sum=[dp]"])
    alone(cfg)
    trainer = Trainer(cfg)
    if dp_shard != "none":
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (D,))
        for block in [*trainer.module.model.layers, trainer.module]:
            fully_shard(block, mesh=mesh, reshard_after_forward=dp_shard == "full")
        trainer.optimizer = adamw(cfg, trainer.module.parameters(), cfg.train.lr)
    trainer.step()
    tracker = AccumulatingTracker()
    tracker.track_external(trainer.module, trainer.optimizer)
    gc.collect()
    with tracker:
        trainer.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    parallel = dataclasses.replace(cfg.parallel, dp_shard=dp_shard)
    launch = dataclasses.replace(cfg.launch, emulate="fake")
    debug = dataclasses.replace(cfg.debug, skip_grad_sum=[])
    predicted = dataclasses.replace(cfg, parallel=parallel, launch=launch, debug=debug)
    one = dataclasses.replace(predicted, train=dataclasses.replace(cfg.train, accumulation=1))
    assert peak == theory.predict(predicted).peak_bytes
    assert peak > theory.predict(one).peak_bytes


@pytest.mark.parametrize("dp_shard", ["none", "optimizer", "full"])
def test_fit_holds_a_row_of_k_micro_steps_to_the_model_of_its_whole_step(dp_shard):
    """tpbench fit: a row with accumulation (global batch 16 over DP 8, micro-batch 1: 2 micro-steps)
    peaks as `plan` predicts its run with train.accumulation=2, over its one micro-step's peak (but
    under ZeRO-1, whose grad buffer holds the gradients in one micro-step's step too)."""
    from tpbench.run import compose
    from tpbench.sizing import fit as fitting

    line = f"model=qwen3_0_6b seq=2048 gpu=H100 nodes=1 tp=1 dp_shard={dp_shard} global_batch=16"
    request = fitting.parse(f"{line} micro_batch=1 recompute=full".split())
    (base,) = compose.expand(request.overrides, single=True, launching=False)
    rows = [r for r in fitting.solve(request, base).rows if not r.reason and r.dp == 8]
    assert rows and all(r.accumulation == 2 for r in rows)
    for row in rows:
        cfg = fitting.solve(request, base).config(row)
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, emulate="none"))
        step = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, accumulation=2))
        one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, accumulation=1))
        assert row.live_bytes == theory.predict(step).peak_bytes
        if dp_shard != "optimizer":
            assert row.live_bytes > theory.predict(one).peak_bytes
