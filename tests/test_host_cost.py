"""The host's cost of a layer, counted, not timed (issue 57, item 4): the non-view aten ops one decoder
layer dispatches, forward and backward, as benchmarks/host_cost.py counts them. At T 1 tpbench's
layer (model.qk_norm=false: Llama's) dispatches no more than transformers' LlamaDecoderLayer at the
same shape and dtype, both counted here, live; MiniMind's own ops (model.fused_ops=false) dispatch
more, so the guard can fail. So does a whole eager training step, phase by phase (forward with the
batch and the loss, backward, AdamW), against LlamaForCausalLM's. At T 2 a rank's layer is T 1's
plus its collectives and at most one op beside each (the buffer it fills or the copy it reduces in
place)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers (Llama's layer): pip install -e '.[hf]'")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "host_cost.py"
_spec = importlib.util.spec_from_file_location("host_cost", SCRIPT)
host_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_cost)

PHASES = ("forward", "backward")


@pytest.fixture(scope="module")
def llama() -> host_cost.LayerCount:
    return host_cost.llama_layer(host_cost.config())


@pytest.fixture(scope="module")
def t1() -> host_cost.LayerCount:
    return host_cost.tpbench_layer()


def over(ours: host_cost.LayerCount, reference: host_cost.LayerCount) -> list[str]:
    """Each phase in which `ours` dispatches more ops than `reference`, with the ops that differ."""
    return [
        f"{phase}: {ours.total(phase)} against {reference.total(phase)} "
        f"({host_cost.difference(getattr(ours, phase), getattr(reference, phase))})"
        for phase in PHASES
        if ours.total(phase) > reference.total(phase)
    ]


def test_a_layer_dispatches_no_more_ops_than_llamas(t1, llama):
    assert t1.total("forward") > 20 and llama.total("forward") > 20  # both counted something
    problems = over(t1, llama)
    assert not problems, "tpbench's layer at T 1 against LlamaDecoderLayer's: " + "; ".join(problems)


def test_minimind_own_ops_dispatch_more_than_llamas(llama):
    """The guard above can fail: MiniMind's own ops (the seed's presets keep them) are over."""
    assert over(host_cost.tpbench_layer("model.fused_ops=false"), llama)


@pytest.fixture(scope="module")
def steps() -> dict[str, list[int]]:
    """Each phase's dispatches in one eager training step (PhaseClock: forward with the batch and the
    loss, backward, optimizer, the rest): tpbench's, with MiniMind's own ops, and LlamaForCausalLM's."""
    cfg = host_cost.config()
    with host_cost.fake_world(1):
        llama, ours = host_cost.LlamaStep(cfg), host_cost.Trainer(cfg)
        own = host_cost.Trainer(host_cost.config("model.fused_ops=false"))
        clocks = {
            "llama": host_cost.PhaseClock(llama, llama.model, llama.optimizer),
            "tpbench": host_cost.PhaseClock(ours.step, ours.module, ours.optimizer),
            "minimind": host_cost.PhaseClock(own.step, own.module, own.optimizer),
        }
        return {name: clock.dispatches() for name, clock in clocks.items()}


def over_in_phases(ours: list[int], reference: list[int]) -> list[str]:
    return [
        f"{phase}: {a} against {b}"
        for phase, a, b in zip(host_cost.PhaseClock.PHASES, ours, reference, strict=True)
        if a > b
    ]


def test_a_step_dispatches_no_more_ops_than_llamas_in_each_phase(steps):
    """The whole step, beside the layers: the embedding, the final norm, the loss and the labels'
    shift (forward), their backward, AdamW's step (optimizer): phase by phase at most Llama's."""
    assert steps["llama"][2] > 70 and steps["tpbench"][1] > 8 * 50  # AdamW's per-tensor ops, the layers
    problems = over_in_phases(steps["tpbench"], steps["llama"])
    assert not problems, "tpbench's eager step against LlamaForCausalLM's: " + "; ".join(problems)


def test_minimind_own_ops_step_dispatches_more_than_llamas(steps):
    """The guard above can fail: with MiniMind's own ops a step's forward is over Llama's."""
    assert over_in_phases(steps["minimind"], steps["llama"])


@pytest.mark.parametrize("mode, collectives", [("tp", (2, 2)), ("tp_sp", (4, 6))])
def test_t2_adds_its_collectives_and_one_op_beside_each_at_most(t1, mode, collectives):
    """Per block at T 2: TP's two all-reduces forward (the region exits) and two backward (the
    entries'); TP+SP's all-gather and reduce-scatter per region forward, and backward the entries'
    reduce-scatters, the exits' all-gathers and the re-gathers of the saved shards."""
    t2 = host_cost.tpbench_layer(f"mode={mode}", tp=2)
    for phase, expected in zip(PHASES, collectives, strict=True):
        added = t2.total(phase, collectives=False) - t1.total(phase)
        change = host_cost.difference(getattr(t2, phase), getattr(t1, phase))
        assert t2.collectives(phase) == expected, f"{phase}: {change}"
        assert added <= expected, f"{phase}: {added} ops beside {expected} collectives ({change})"
