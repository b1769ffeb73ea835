"""The seed's presets compose to the configs their comments and the published figures state (no launch)."""

from __future__ import annotations

import pytest

from tpbench.config import local_batch, mode_label
from tpbench.report import published
from tpbench.run import compose


def test_seed_check_is_the_seeds_numerical_check():
    """T 2, H 128, L 6, heads 8/4, V 6400, S 256, fp32, 200 AdamW steps on one fixed batch, the logits
    compared every 20 steps, every TP mode: each a run the report sets beside the published figures."""
    runs = compose.expand(["+preset=seed_check"])
    assert [mode_label(c.parallel) for c in runs] == ["tp", "tp_sp", "tp_vp", "tp_sp_vp"]
    for c in runs:
        m = c.model
        assert (c.kind, c.sweep, c.parallel.tp, c.parallel.dp) == ("validate", "seed_check", 2, 1)
        assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads) == (
            128,
            6,
            8,
            4,
        )
        assert (m.vocab_size, c.train.seq_len, c.train.dtype, c.train.precision) == (
            6400,
            256,
            "float32",
            "pure",
        )
        assert (c.validate.batch, c.validate.steps, c.validate.every) == ("fixed", 200, 20)
        assert c.validate.lr == 5e-4  # not stated by the seed: tpbench's own, as the preset says
        stored = {
            "tp": c.parallel.tp, "dp": c.parallel.dp, "layers": m.num_hidden_layers, "hidden": m.hidden_size,
            "heads": m.num_attention_heads, "kv_heads": m.num_key_value_heads, "vocab": m.vocab_size,
            "seq": c.train.seq_len, "dtype": c.train.dtype, "adamw_steps": c.validate.steps,
            "validate_batch": c.validate.batch,
        }  # fmt: skip
        assert stored == published.SEED_CHECK_SETTING


def test_the_fresh_batch_check_stays_an_option():
    runs = compose.expand(["+preset=seed_check", "validate.batch=fresh", "mode=tp"])
    assert [(c.validate.batch, c.validate.steps) for c in runs] == [("fresh", 200)]
    assert compose.expand(["kind=validate"])[0].validate.batch == "fresh"  # the default, as before
    with pytest.raises(compose.ConfigError, match=r"^validate.batch='same': accepted are 'fresh', 'fixed'$"):
        compose.expand(["kind=validate", "validate.batch=same"])
    with pytest.raises(
        compose.ConfigError, match=r"^validate.tol_drift=-1.0: accepted are finite numbers >= 0$"
    ):
        compose.expand(["kind=validate", "validate.tol_drift=-1"])


def test_seed_throughput_trains_the_same_tokens_in_every_mode():
    """DDP, TP, TP+SP, TP+VP, TP+SP+VP at fixed_global: the same global batch, the same tokens per step,
    on minimind-tron's model at S 128 in fp32 on the CPU."""
    runs = compose.expand(["+preset=seed_throughput"])
    assert [mode_label(c.parallel) for c in runs] == ["ddp", "tp", "tp_sp", "tp_vp", "tp_sp_vp"]
    assert {(c.parallel.tp, c.parallel.dp) for c in runs} == {(1, 2), (2, 1)}
    tokens = {local_batch(c) * c.parallel.dp * c.train.seq_len for c in runs}
    assert tokens == {4 * 128}
    for c in runs:
        m = c.model
        assert (c.kind, c.sweep, c.train.batch, c.launch.device) == (
            "throughput",
            "seed_throughput",
            "fixed_global",
            "cpu",
        )
        assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads) == (
            768,
            8,
            8,
            4,
        )
        assert (m.vocab_size, c.train.dtype) == (6400, "float32")
