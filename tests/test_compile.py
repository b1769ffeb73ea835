"""train.compile and train.fused_optimizer (issue 57): `auto` resolved with the device, the recorded
runs' identities kept, and compiled blocks that validate with every engine, DP level and recompute
level (in the shared world-2 and world-4 torchrun jobs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from beside import beside
from torchrun_checks import TINY, WORLD2, WORLD4, per_config, run_config, same_on_every_rank

from tpbench.config import ConfigError, config_hash
from tpbench.predict import theory
from tpbench.run.compose import expand

# The hashes of these configs as commit b01d731 (train.compile and fused_optimizer plain bools, false)
# made them: a recorded run of each keeps its identity once `auto` is resolved to false on a CPU, and a
# CUDA run that `auto` compiles and fuses has the identity of one that asked for both.
# They ran the input-only RMSNorm, the default then (model.lean_rmsnorm=true): said here, as auto
# resolves it to false without recompute (a new default run, another identity: test_lean_rmsnorm_auto).
LEAN = "model.lean_rmsnorm=true"
RECORDED = {
    ("kind=validate", "launch.device=cpu", LEAN): "214010c7bd5ed45b",
    ("kind=throughput", "launch.device=cpu", LEAN): "d2486ccb91dad410",
    ("kind=throughput", "launch.device=cuda", LEAN): "1373013401c856db",  # compile=true fused_optimizer=true
    ("kind=throughput", "launch.device=cuda", "compile=false", "fused=false", LEAN): "20e5800956cc1dc9",
}


FUSED = {"fused=true": "train.fused_optimizer=true", "fused=false": "train.fused_optimizer=false"}


def resolved(*overrides: str):
    (cfg,) = expand([FUSED.get(o, o) for o in overrides], single=True, launching=False)
    return cfg.train.compile, cfg.train.fused_optimizer


@pytest.mark.parametrize("overrides, expected", RECORDED.items())
def test_auto_keeps_the_recorded_identities(overrides, expected):
    (cfg,) = expand([FUSED.get(o, o) for o in overrides], single=True, launching=False)
    assert config_hash(cfg) == expected


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["kind=validate", "launch.device=cpu"], (False, False)),
        (["kind=throughput", "launch.device=cpu"], (False, False)),
        (["kind=validate", "launch.device=cuda"], (True, True)),
        (["kind=throughput", "launch.device=cuda"], (True, True)),
        (["kind=memory", "launch.device=cuda"], (False, True)),  # the memory model counts eager tensors
        (["kind=memory", "launch.device=cuda", "compile=true"], (False, True)),
        (["kind=throughput", "launch.device=cpu", "compile=true", "fused=true"], (True, True)),
        (["kind=throughput", "launch.device=cpu", "compile=true"], (True, True)),  # fused beside compile
        (["kind=memory", "launch.device=cpu", "compile=true"], (False, False)),  # eager: torch's default
        (["kind=throughput", "launch.device=cpu", "compile=true", "fused=false"], (True, False)),
        (["kind=throughput", "launch.device=cuda", "compile=false", "fused=false"], (False, False)),
        # SP's re-gather breaks the graph: auto stays eager there, compile=true is refused
        (["kind=throughput", "launch.device=cuda", "mode=tp_sp"], (False, True)),
        (["kind=throughput", "launch.device=cuda", "mode=tp_sp", "parallel.sp_regather=false"], (True, True)),
        # torch 2.13's DTensor under VP fails in a compiled backward: auto stays eager there
        (["kind=throughput", "launch.device=cuda", "mode=dtensor_tp_vp"], (False, True)),
        # dropout compiles (its masks' key a tensor: tests below)
        (
            ["kind=validate", "launch.device=cuda", "model.dropout=0.1", "model.flash_attn=false"],
            (True, True),
        ),
    ],
)
def test_auto_is_on_for_cuda_throughput_and_validate_only(overrides, expected):
    assert resolved(*overrides) == expected


@pytest.mark.parametrize(
    "overrides, lean",
    [
        (["kind=throughput"], False),  # no recompute: torch's norm, no checkpoint (fewer dispatches)
        (["kind=memory"], False),
        (["kind=memory", "recompute=selective"], True),  # memory asked for: the input-only norm
        (["kind=throughput", "recompute=full"], True),
        (["kind=throughput", "model.lean_rmsnorm=true"], True),
        (["kind=memory", "recompute=full", "model.lean_rmsnorm=true"], True),
    ],
)
def test_lean_rmsnorm_auto_is_on_where_recompute_asks_for_memory(overrides, lean):
    (cfg,) = expand(["launch.device=cpu", *overrides], single=True, launching=False)
    assert cfg.model.lean_rmsnorm is lean
    said = f"model.lean_rmsnorm={str(lean).lower()}"
    (pinned,) = expand(["launch.device=cpu", *overrides, said], single=True, launching=False)
    assert config_hash(cfg) == config_hash(pinned)  # the resolved bool is the run's identity


def test_an_unresolved_lean_rmsnorm_auto_is_never_read_as_true():
    from tpbench.config import RunConfig
    from tpbench.experiments.setup import model_config
    from tpbench.predict.theory import dims

    cfg = RunConfig()  # built directly, not composed: lean_rmsnorm stays "auto"
    assert model_config(cfg).lean_rmsnorm is False and dims(cfg).lean_rmsnorm is False
    cfg.train.recompute = "selective"
    assert model_config(cfg).lean_rmsnorm is True and dims(cfg).lean_rmsnorm is True


@pytest.mark.parametrize(
    "override, said",
    [
        ("compile=maybe", "train.compile=maybe: accepted are auto, true, false"),
        ("model.lean_rmsnorm=sometimes", "model.lean_rmsnorm=sometimes: accepted are auto, true, false"),
        ("compile=1", "train.compile=1: accepted are auto, true, false"),
        ("train.fused_optimizer=yes", "train.fused_optimizer=yes: accepted are auto, true, false"),
        ("compile=true mode=tp_sp", "train.compile=true with parallel.sp_regather=true"),
        ("compile=true mode=dtensor_tp_vp", "train.compile=true with parallel.engine=dtensor and"),
        (
            "compile=true mode=dtensor_tp recompute=full",
            "train.compile=true with parallel.engine=dtensor and train.recompute=full",
        ),
    ],
)
def test_a_bad_switch_is_one_line(override, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")) as e:
        expand(["kind=validate", *override.split()], single=True, launching=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("compile_, said", [("true", True), ("false", False)])
def test_a_memory_run_beside_compiled_ones_says_it_runs_eager(capsys, compile_, said):
    from tpbench.cli.progress import say_estimates

    cfgs = expand(["kind=all", f"compile={compile_}", "launch.device=cpu"], single=True, launching=False)
    assert [c.train.compile for c in cfgs if c.kind == "memory"] == [False]
    say_estimates(cfgs, sweep=False)
    assert ("memory runs eager: the memory model counts eager tensors" in capsys.readouterr().err) is said


def test_inductors_cache_is_kept_in_tpbenchs_cache_folder(monkeypatch, tmp_path):
    """A run's compiled kernels land in $TPBENCH_CACHE_DIR/inductor, kept across runs (not in a folder
    of /tmp per user, nor one per process); a TORCHINDUCTOR_CACHE_DIR given is kept."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from tpbench.models.minimind import MiniMindConfig, build_model
    from tpbench.parallel.compiled import apply_compile

    model = build_model(MiniMindConfig(hidden_size=64, num_hidden_layers=1, vocab_size=256))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TPBENCH_CACHE_DIR", str(tmp_path))
    apply_compile(model)
    assert cache_dir() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "given"))
    apply_compile(model)
    assert cache_dir() == str(tmp_path / "given")


# --- compiled blocks validate where compile was refused before (issue 57, item 2) ----------------
# Each config lifts one or two refusals at once (a compile costs 6-10 CPU s a config on an idle EPYC):
# the DDP engine with selective recompute, DTensor's TP, our engine under ZeRO-1 with full recompute,
# FSDP2 (ZeRO-3), and HSDP of ZeRO-2 (world 4). Each is validated against the dense model and its
# reference, as every validate run is: compiled, each passes within the same bounds as eager.
COMPILED_T2 = {
    "ddp_selective": ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=2", "train.recompute=selective"],
    "dtensor_tp": ["parallel.engine=dtensor", "parallel.tp=2"],
    "zero1_full": ["parallel.tp=1", "parallel.dp=2", "parallel.dp_shard=optimizer", "train.recompute=full"],
    "fsdp": ["parallel.tp=1", "parallel.dp=2", "parallel.dp_shard=full"],
}
# per-op recompute compiled: the policy marks the graph's ops, tpbench's collectives (custom ops there)
# kept: the counted collectives are eager's, none again in backward
OP = "train.recompute=op"
COMPILED_T2["tp_sp_op"] = ["parallel.tp=2", "parallel.sp=true", "parallel.sp_regather=false", OP]
# and on DTensor's engine, whose functional all-gathers the policy recomputes (full is refused there)
COMPILED_T2["dtensor_tp_sp_op"] = [
    "parallel.engine=dtensor", "parallel.tp=2", "parallel.sp=true", "parallel.sp_regather=false", OP
]  # fmt: skip
COMPILED_T4 = {
    "hsdp_zero2": ["parallel.tp=1", "parallel.dp=4", "parallel.dp_shard=grads", "parallel.dp_replicate=2"],
}
# model.dropout compiled (its masks' key a tensor, DropoutKey): the DDP engine above draws its DP slice's
# masks, tpbench's TP+SP under full recompute its heads' and sequence shard's, recomputed in backward;
# with the head offset left out (debug.dropout_fault) the compiled blocks must fail validation
DROPOUT = ["model.dropout=0.1"]
COMPILED_T2["ddp_selective"] += DROPOUT
COMPILED_T2["dropout_tp_sp_full"] = [
    "parallel.tp=2", "parallel.sp=true", "parallel.sp_regather=false", "train.recompute=full", *DROPOUT
]  # fmt: skip
ONE_STEP = ["validate.steps=1", "validate.every=1"]
NO_HEAD_OFFSET = "debug.dropout_fault=no_head_offset"
MISPLACED = {"misplaced_dropout": ["parallel.tp=2", *DROPOUT, NO_HEAD_OFFSET, *ONE_STEP]}
# DTensor's eager twin: its first step (the one that counts collectives) runs eager, so only the AdamW
# steps after it show that its blocks were compiled: their logits drift otherwise than eager's
EAGER_TWIN = {"dtensor_tp_eager": COMPILED_T2["dtensor_tp"]}
# Inductor compiles where its code is what is checked: DTensor's functional collectives lowered (its
# AdamW steps drift otherwise than eager's) and the dropout masks' random bits in generated code (the
# TP+SP run must draw the dense model's masks there: a kernel that dropped an offset fails it). The DP
# levels, DDP and per-op recompute change what the graph holds, not inductor's code: aot_eager compiles
# them (Dynamo's graph, AOTAutograd's split and recompute policy, eager kernels), at about a quarter of
# a cold inductor cache's cost, which CI pays on every run. So does the planted misplaced mask: the
# fault is in the traced graph (the offset it leaves out), which any backend runs as traced; what it
# shows is that validation sees a compiled model draw another shard's masks (27-32 CPU s of inductor
# cold, 2026-12-07, for that).
INDUCTOR = ("dtensor_tp", "dropout_tp_sp_full")


def compiled_by(name: str) -> list[str]:
    return ["train.compile=true", *([] if name in INDUCTOR else ["train.compile_backend=aot_eager"])]


WORLD2.add(
    "validate",
    "compiled",
    {k: [*TINY, *v, *compiled_by(k)] for k, v in (COMPILED_T2 | MISPLACED).items()}
    | {k: [*TINY, *v, "train.compile=false"] for k, v in EAGER_TWIN.items()},
)
WORLD4.add("validate", "compiled", {k: [*TINY, *v, *compiled_by(k)] for k, v in COMPILED_T4.items()})


@beside
def compiled(folder: Path) -> dict:
    """Rank 0's results, the same on every rank but each rank's count of Dynamo's graphs (`graphs`: the
    DP reduce check of a DP rank but 0 draws rank 0's dropout masks, their split one graph more there)
    and the failed checks' lines (rank 0's, as test_parallel's)."""
    out = {}
    for world in (WORLD2, WORLD4):
        for name, ranks in per_config(world.part(folder, "validate", "compiled")).items():
            graphs = [r["metrics"].pop("compile_graphs", None) if isinstance(r, dict) else 0 for r in ranks]
            out[name] = same_on_every_rank([{k: r[k] for k in ("metrics", "comm", "drift")} for r in ranks])
            out[name] |= {"graphs": graphs, "failed": ranks[0]["failed"]}  # the lines are rank 0's alone
    return out


@pytest.mark.parametrize("name", [*COMPILED_T2, *COMPILED_T4])
def test_compiled_blocks_validate_on_every_engine_dp_level_and_recompute(compiled, name):
    """fullgraph per block (a graph break would fail the run), Dynamo's graphs made and counted on every
    engine (DTensor's first step, the one that counts collectives, runs eager: its graphs come later)."""
    r = compiled[name]
    assert r["failed"] == [] and r["metrics"]["passed"] == 1.0
    assert r["metrics"]["compile_graph_breaks"] == 0
    assert min(r["graphs"]) >= 1


@pytest.mark.parametrize("name", ["tp_sp_op"])  # names its config: -k runs that one alone
def test_compiled_op_recompute_communicates_no_more_than_the_model(compiled, name):
    """Compiled, the policy keeps tpbench's collectives (custom ops in the graph): the counted ones are
    the analytic model's, with none run again in backward (counted under their forward purpose there)."""
    cfg = run_config([*TINY, *COMPILED_T2[name], *compiled_by(name)])
    predicted = sorted([r.op, r.purpose, r.count, r.bytes] for r in theory.predict(cfg).rows)
    assert sorted(compiled[name]["comm"]) == predicted


@pytest.mark.parametrize("name, eager", [("dtensor_tp", "dtensor_tp_eager")])
def test_dtensors_compiled_adamw_steps_are_not_eagers(compiled, name, eager):
    """DTensor's first step runs eager (it counts the collectives), the same figures as eager's; its
    AdamW steps run compiled: their logits drift otherwise, inductor's sums not being eager's."""
    on, off = compiled[name], compiled[eager]
    assert off["failed"] == [] and off["metrics"]["passed"] == 1.0
    assert on["metrics"]["fwd_logits_max_abs"] == off["metrics"]["fwd_logits_max_abs"]
    assert on["drift"] != off["drift"]


@pytest.mark.parametrize("name", MISPLACED)
def test_a_compiled_dropout_drawing_another_shards_mask_fails(compiled, name):
    """Compiled, a rank that draws another head shard's masks is a different model: validation fails at
    its first forward, as eager (test_parallel's misplaced_dropout_*)."""
    m = compiled[name]["metrics"]
    assert m["passed"] == 0.0 and m["fwd_logits_max_abs"] > 1e-2 and min(compiled[name]["graphs"]) >= 1
    assert [f.split()[0] for f in compiled[name]["failed"]][:2] == ["fwd_logits_max_abs", "loss_abs_diff"]


def test_compiled_dropout_draws_eagers_masks_and_never_recompiles():
    """A step's new dropout key is a compiled block's input, not a constant: Dynamo's graphs stay those
    of the first step (one, shared by the blocks) while the steps draw new masks, each eager's."""
    import copy

    import torch
    from torch._dynamo.utils import counters

    from tpbench.models.minimind import MiniMindConfig, build_model
    from tpbench.parallel.compiled import apply_compile

    cfg = MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=64, flash_attn=False, dropout=0.5)  # fmt: skip
    model = build_model(cfg, seed=3)
    eager = copy.deepcopy(model)
    apply_compile(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    graphs, losses = [], []
    for _ in range(3):
        (logits, loss), (want, _) = model(ids, ids), eager(ids, ids)
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)  # the same masks: else ~1e-1
        graphs.append(counters["stats"]["unique_graphs"])
        losses.append(loss.item())
    assert graphs == [1, 1, 1] and sum(counters["graph_break"].values()) == 0
    assert model.compile_graphs.count == 1  # validate's compile_graphs, counted to this model
    assert len(set(losses)) == 3  # each step its own masks


def test_aot_eager_compiles_the_blocks_without_inductor(monkeypatch):
    """train.compile_backend=aot_eager: each block is Dynamo's graph (fullgraph, counted as inductor's)
    split by AOTAutograd, with no code generated: inductor is never called, and the compiled model's
    loss and gradients are eager's within rounding."""
    import copy

    import torch
    import torch._inductor.compile_fx

    from tpbench.models.minimind import MiniMindConfig, build_model
    from tpbench.parallel.compiled import apply_compile

    def refused(*args, **kwargs):
        raise AssertionError("inductor called under aot_eager")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", refused)
    cfg = MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=64, flash_attn=False)  # fmt: skip
    model = build_model(cfg, seed=1)
    eager = copy.deepcopy(model)
    apply_compile(model, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    (_, loss), (_, want) = model(ids, ids), eager(ids, ids)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert model.compile_graphs.count == 1  # one graph, shared by the blocks


def test_an_unknown_compile_backend_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^train.compile_backend='tvm': accepted are inductor, aot_eager$"):
        expand(["train.compile_backend=tvm"], single=True, launching=False)


def test_a_runs_workers_inherit_tpbenchs_inductor_cache(tmp_path):
    """The CLI's estimate imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR to torch's default
    (/tmp/torchinductor_$USER) where it is unset, and a run's workers inherit the CLI's environment: the
    CLI names tpbench's folder first, so the workers compile into it (seen: every compiled run's kernels
    in /tmp while $TPBENCH_CACHE_DIR/inductor stayed empty)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TPBENCH_CACHE_DIR"] = str(tmp_path)
    code = (
        "import os\n"
        "import tpbench.cli\n"
        "from tpbench.cli.progress import say_estimates\n"
        "from tpbench.run.compose import expand\n"
        "say_estimates(expand(['kind=validate', 'compile=true', 'model.flash_attn=false']), sweep=False)\n"
        "import torch._dynamo\n"
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(tmp_path / "inductor")
