"""tpbench.run.compose composes each selection of config groups once per process and applies the value
overrides with Hydra's own `_apply_overrides_to_config` (what Hydra's compose does after its defaults
list): the runs and the refusals must be those of Hydra's whole compose, and a sweep of one selection
must compose once."""

from __future__ import annotations

import dataclasses

import pytest

from tpbench.config import ConfigError
from tpbench.run import compose

CASES = [
    ["kind=validate", "tp=2", "sp=true", "vp=true", "layers=4"],
    ["mode=tp_sp_vp", "model=qwen3_8b", "layers=2", "seq=64"],
    ["+preset=seed_check", "mode=tp,tp_vp", "validate.steps=3"],
    ["kind=all", "dp=2", "dp_shard=full", "precision=mixed", "dtype=bfloat16"],
    ["train.no_decay=[norms,biases]", "train.lr_scheduler.decay_ratio=null", "train.weight_decay=0.1"],
    ["db=postgres", "launcher=slurm", "launch.slurm.time_min=10"],
    ["model.hidden_size=64", "model.hidden_size=128"],  # the last one wins, as in Hydra
    ["+fault=raise_on_rank1", "kind=validate"],
    ["+model.extra=3"],  # refused: not a tpbench setting
    ["~model.hidden_size"],
    ["model.hidden_size=abc"],
    ["nope.key=1"],
    ["model=nope"],
    ["hydra.job.name=x", "layers=2"],  # Hydra's own node: composed whole
]


def outcome(overrides: list[str]) -> object:
    try:
        return [dataclasses.asdict(run) for run in compose.expand(overrides, launching=False)]
    except ConfigError as e:
        return ("refused", str(e))


@pytest.mark.parametrize("overrides", CASES, ids=" ".join)
def test_the_cached_compose_is_hydras_whole_compose(monkeypatch, overrides):
    cached = [outcome(overrides), outcome(overrides)]  # the second from the cache
    whole = compose._compose_whole
    monkeypatch.setattr(compose, "_compose", lambda o, typed, hydra=False: whole(o, typed, hydra))
    assert cached == [outcome(overrides)] * 2


def test_a_sweep_of_one_selection_composes_once(monkeypatch):
    calls = []
    whole = compose._compose_whole
    monkeypatch.setattr(compose, "_COMPOSED", {})
    monkeypatch.setattr(compose, "_compose_whole", lambda *a, **k: calls.append(a[0]) or whole(*a, **k))
    runs = compose.expand(["kind=validate", "mode=tp", "layers=1,2,3,4", "model.hidden_size=64,128"])
    assert [(r.model.num_hidden_layers, r.model.hidden_size) for r in runs] == [
        (n, h) for n in (1, 2, 3, 4) for h in (64, 128)
    ]
    assert calls == [["kind=validate", "mode=tp"]]
