"""The host's cost of a layer, counted, not timed (issue 57, item 4): the non-view aten ops one decoder
layer dispatches, forward and backward, as benchmarks/host_cost.py counts them. At T 1 tpbench's
layer (model.qk_norm=false: Llama's) dispatches no more than transformers' LlamaDecoderLayer at the
same shape and dtype, both counted here, live; MiniMind's own ops (model.fused_ops=false) dispatch
more, so the guard can fail. At T 2 a rank's layer is T 1's plus its collectives and at most one op
beside each (the buffer it fills or the copy it reduces in place)."""

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
