"""The "peak at" column of `tpbench plan` and `tpbench fit` (the predicted peak's moment) against where
the measured peak fell: the phase of the step and the module running (memory.PeakTracker records it,
RankResult.peak_at), on every rank of every config of test_theory's world-4 launch (shared: its
`measured` job runs once; this file sorts after test_theory.py, so the job is done by then)."""

from __future__ import annotations

import re

import pytest
from test_theory import CHECKS, config, measured  # noqa: F401 (measured: the shared job's fixture)

from tpbench.config import RunConfig
from tpbench.predict import theory

ROOTS = ("DistributedDataParallel.module.", "MiniMindForCausalLM.")  # DDP's wrapper, the model
PHASES = ("after backward", "forward", "backward", "optimizer")


def expected(cfg: RunConfig, moment: str) -> tuple[str, str]:
    """Where a moment of the model happens: (phase, module under the model; "" for none).

    The dense loss's moment is its backward's first op (log_softmax's), in the model's loss_fn; the
    seed's logits mean runs outside the model. Per-block moments are the top block's (backward meets
    it first), the bottom block's for full recompute's replay (named with its layer)."""
    top = f"model.layers.{cfg.model.num_hidden_layers - 1}"
    loss = "loss_fn" if cfg.train.loss == "cross_entropy" else ""
    if found := re.fullmatch(r"recomputed (block|attention|attention dropout|softmax) (\d+)", moment):
        kind, layer = found.groups()
        return "backward", f"model.layers.{layer}" + ("" if kind == "block" else ".self_attn")
    if found := re.fullmatch(r"recomputed (swiglu|post-attention norm) (\d+)", moment):
        kind, layer = found.groups()
        return "backward", f"model.layers.{layer}." + {"swiglu": "mlp"}.get(kind, "post_attention_layernorm")
    return {
        "loss": ("backward", loss),
        "loss forward": ("forward", loss),
        "attention forward": ("forward", f"{top}.self_attn"),
        "attention dropout": ("forward", f"{top}.self_attn"),
        "head backward": ("backward", "lm_head"),
        "head weight cast's backward": ("backward", "lm_head"),
        "final norm backward": ("backward", "model.norm"),
        "swiglu backward": ("backward", f"{top}.mlp"),
        "down_proj backward": ("backward", f"{top}.mlp"),
        "down_proj weight cast's backward": ("backward", f"{top}.mlp.down_proj"),
        "post-attention norm backward": ("backward", f"{top}.post_attention_layernorm"),
        "q_norm backward": ("backward", f"{top}.self_attn.q_norm"),
        "k_norm backward": ("backward", f"{top}.self_attn.k_norm"),
        "embedding backward": ("backward", "model.embed_tokens"),
        "backward end": ("backward", "model.embed_tokens"),
        "gradient sums": ("after backward", ""),
        "optimizer": ("optimizer", ""),
    }[moment]


def running(peak_at: str) -> tuple[str, list[str]]:
    """A measured "<phase> <module> ..." as (phase, the modules running, named under the model; ""
    for none: "Global")."""
    phase = next(p for p in PHASES if peak_at.startswith(f"{p} "))
    names = []
    for name in peak_at[len(phase) + 1 :].split():
        for root in ROOTS:
            name = name.removeprefix(root)
        names.append("" if name == "Global" else name)
    return phase, names


def test_a_measured_moment_reads_as_phase_and_modules():
    assert running("after backward Global") == ("after backward", [""])
    assert running("backward DistributedDataParallel.module.lm_head") == ("backward", ["lm_head"])
    both = "backward MiniMindForCausalLM.model.layers.1.self_attn.k_norm MiniMindForCausalLM.model.norm"
    assert running(both) == ("backward", ["model.layers.1.self_attn.k_norm", "model.norm"])


@pytest.mark.parametrize("name", CHECKS)
def test_the_predicted_peak_moment_is_where_every_rank_measured_its_peak(measured, name):  # noqa: F811
    cfg = config(name)
    moment = theory.predict(cfg).peak.name
    phase, module = expected(cfg, moment)
    for rank, result in enumerate(measured[name]):
        seen_phase, seen = running(result["peak_at"])
        at = f"rank {rank}: predicted {moment!r} ({phase} {module or 'outside the model'}), measured {seen}"
        assert seen_phase == phase, at
        if module:
            assert any(m == module or m.startswith(f"{module}.") for m in seen), at
        else:
            assert seen == [""], at
