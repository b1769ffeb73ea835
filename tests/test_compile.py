"""train.compile and train.fused_optimizer (issue 57): `auto` resolved with the device, the recorded
runs' identities kept, and compiled blocks that validate with every engine, DP level and recompute
level (in the shared world-2 torchrun job)."""

from __future__ import annotations

import pytest

from tpbench.config import ConfigError, config_hash
from tpbench.run.compose import expand

# The hashes of these configs as commit b01d731 (train.compile and fused_optimizer plain bools, false)
# made them: a recorded run of each keeps its identity once `auto` is resolved to false on a CPU, and a
# CUDA run that `auto` compiles and fuses has the identity of one that asked for both.
RECORDED = {
    ("kind=validate", "launch.device=cpu"): "214010c7bd5ed45b",
    ("kind=throughput", "launch.device=cpu"): "d2486ccb91dad410",
    ("kind=throughput", "launch.device=cuda"): "1373013401c856db",  # compile=true fused_optimizer=true
    ("kind=throughput", "launch.device=cuda", "compile=false", "fused=false"): "20e5800956cc1dc9",
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
        (["kind=throughput", "launch.device=cuda", "compile=false", "fused=false"], (False, False)),
        # SP's re-gather breaks the graph: auto stays eager there, compile=true is refused
        (["kind=throughput", "launch.device=cuda", "mode=tp_sp"], (False, True)),
        (["kind=throughput", "launch.device=cuda", "mode=tp_sp", "parallel.sp_regather=false"], (True, True)),
        (
            ["kind=validate", "launch.device=cuda", "model.dropout=0.1", "model.flash_attn=false"],
            (False, True),
        ),
    ],
)
def test_auto_is_on_for_cuda_throughput_and_validate_only(overrides, expected):
    assert resolved(*overrides) == expected


@pytest.mark.parametrize(
    "override, said",
    [
        ("compile=maybe", "train.compile=maybe: accepted are auto, true, false"),
        ("compile=1", "train.compile=1: accepted are auto, true, false"),
        ("train.fused_optimizer=yes", "train.fused_optimizer=yes: accepted are auto, true, false"),
        ("compile=true mode=tp_sp", "train.compile=true with parallel.sp_regather=true"),
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
