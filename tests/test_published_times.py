"""The time model against the published GPU time tables, each row against the goal its results page
states (docs/results/time_model.md): Korthikanti et al. 2022, Table 4, one layer of their 22B GPT at
TP 8 on eight A100s, as benchmarks/korthikanti_table4.py predicts it (about 2.5 CPU s: left out of
the quick tier)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.not_quick

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "korthikanti_table4.py"


def script():
    spec = importlib.util.spec_from_file_location("korthikanti_table4", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def korthikanti():
    return script()


@pytest.fixture(scope="module")
def predicted(korthikanti) -> dict[str, tuple[float, float, float]]:
    return korthikanti.predicted()


def test_korthikanti_table4_meets_its_goals(korthikanti, predicted):
    """Each total within 15% of the published one (TP+SP and selective + SP no further off than the
    -15.2% and -15.5% issue 60 accepts), full recompute 30-45% over TP, selective 3-12%, SP within 5%
    of the same row without it."""
    table = "\n".join(f"{name}: {ms[0]:.2f} + {ms[1]:.2f} = {ms[2]:.2f} ms" for name, ms in predicted.items())
    assert set(predicted) == {name for name, _, _ in korthikanti.ROWS}
    assert korthikanti.missed({name: ms[2] for name, ms in predicted.items()}) == [], table


def test_each_korthikanti_goal_can_be_missed(korthikanti):
    """The goals bite: published totals met, then a row 16% low, the accepted rows past their figure,
    full recompute costing nothing, SP saving a tenth."""
    published = {name: ms[2] for name, _, ms in korthikanti.ROWS}
    assert korthikanti.missed(published) == []
    low = dict(published, TP=0.84 * published["TP"])
    assert [m.split(":")[0] for m in korthikanti.missed(low)][0] == "TP"
    worse = {name: total * (0.84 if name in korthikanti.ACCEPTED else 1) for name, total in published.items()}
    assert {m.split(":")[0] for m in korthikanti.missed(worse)} >= set(korthikanti.ACCEPTED)
    free = dict(published, **{"full recompute": published["TP"]})
    assert any(m.startswith("full recompute over TP") for m in korthikanti.missed(free))
    saving = dict(published, **{"TP+SP": 0.9 * published["TP"]})
    assert any(m.startswith("TP+SP against TP") for m in korthikanti.missed(saving))
