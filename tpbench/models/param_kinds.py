"""What train.no_decay calls each parameter, by its name alone (no torch): the AdamW groups of
tpbench.experiments.optim and the memory model's order of AdamW's steps over them
(tpbench.predict.theory.weights.adam_groups) both read it."""

from __future__ import annotations

EMBEDDING = "model.embed_tokens.weight"


def kind_of(name: str) -> str:
    """What train.no_decay calls the parameter `name`: norms, biases, embeddings, or weights (a
    projection's weight matrix, an untied LM head: always decayed)."""
    if name.endswith(".bias"):
        return "biases"
    if name == EMBEDDING:
        return "embeddings"
    if name.endswith(".weight") and name.rsplit(".", 2)[-2].endswith("norm"):
        return "norms"
    return "weights"
