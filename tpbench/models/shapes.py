"""The model's shape rules that config checks need before torch loads (tpbench.parallel.checks):
kept apart from tpbench.models.minimind, which imports torch."""

from __future__ import annotations

import math


def default_intermediate_size(hidden_size: int) -> int:
    """MiniMind's MLP width when model.intermediate_size is not given: H x pi, rounded up to 64."""
    return math.ceil(hidden_size * math.pi / 64) * 64


def model_name(m) -> str:
    """A model config's name: its preset's, else its config.json's file name."""
    if m.name:
        return m.name
    return m.hf_config.rstrip("/").rsplit("/", 1)[-1] if m.hf_config else "model"


def shape_label(m) -> str:
    """A model config's resolved shape in one line (`m`: a tpbench.config.ModelConfig): what two models
    of one H and L can still differ in, defaults resolved (MLP width, head_dim, RoPE theta, tying), e.g.
    "L2 H64 I256 heads 8/4 head_dim 8 V256 theta 1e+06 tied"."""
    width = m.intermediate_size or default_intermediate_size(m.hidden_size)
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    return (
        f"L{m.num_hidden_layers} H{m.hidden_size} I{width} heads {m.num_attention_heads}/"
        f"{m.num_key_value_heads} head_dim {head_dim} V{m.vocab_size} theta {m.rope_theta:g} "
        + ("tied" if m.tie_word_embeddings else "untied")
    )
