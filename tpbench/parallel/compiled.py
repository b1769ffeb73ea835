"""train.compile: each transformer block compiled on its own by inductor, as torchtitan's regional
compile (`apply_compile`: per block, fullgraph, after TP and recompute, before DP wraps the model), so
the repeated structure compiles once and the embedding and head stay eager. Every engine and DP level
compiles the same way: tpbench's own engine and DTensor's blocks once sharded, DDP's dense blocks
before DDP wraps them, ZeRO-1 and FSDP2 over the compiled blocks.

Inductor's on-disk caches (its FX graph cache and AOTAutograd's) live in one folder kept across runs,
`inductor_cache()`: $TPBENCH_CACHE_DIR/inductor (default ~/.cache/tpbench/inductor), unless
TORCHINDUCTOR_CACHE_DIR names another; a run whose blocks were compiled before, by any run of the
same shapes, reads its kernels back instead of compiling them (a cold cache costs `first_step_s`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tpbench.models.minimind import MiniMindForCausalLM


def apply_compile(model: MiniMindForCausalLM, between_linears: bool = False) -> None:
    """train.compile: each block compiled on its own, in place, as torchtitan does (the names of the
    parameters stay). fullgraph: a graph break is an error, not a silent fallback to eager. The blocks'
    collectives go into the graph as tpbench's registered custom ops (tpbench.parallel.comm), so they
    are counted as without compile. The blocks share one compiled graph (their parameters are its
    inputs). Graphs compiled earlier in this process, for another model, are dropped first (a test
    launch builds many), so that each model compiles within Dynamo's recompile limit, and Dynamo's
    counters restart (validate reports its graphs and graph breaks).

    between_linears (parallel.overlap): each block's norms and SwiGLU are compiled instead, and the
    linears and their collectives stay eager: overlap's backward launches a collective, runs the
    deferred weight gradients (Python) and waits, an order a compiled backward graph would not keep.
    The attention core (RoPE, SDPA) stays eager too: cut out of Attention.forward as a function of
    its own, its tensors would live otherwise than tpbench.predict.theory counts them. SP's re-gather saves
    through saved_tensors_hooks outside these pieces, so it needs no sp_regather=false."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache()))  # read when inductor compiles
    from torch._inductor import config as inductor_config  # here: an eager run loads no inductor

    inductor_config.fx_graph_cache = True  # torch's default, said here: the cache is the point
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for block in model.model.layers:
        if not between_linears:
            block.compile(fullgraph=True)
            continue
        attn, mlp = block.self_attn, block.mlp
        head_norms = (attn.q_norm, attn.k_norm) if attn.qk_norm else ()
        for norm in (block.input_layernorm, block.post_attention_layernorm, *head_norms):
            norm.compile(fullgraph=True)
        mlp.act = torch.compile(mlp.act, fullgraph=True)


def inductor_cache() -> Path:
    """The folder of inductor's on-disk caches, beside tpbench's other caches (rates.json)."""
    return Path(os.environ.get("TPBENCH_CACHE_DIR") or Path.home() / ".cache" / "tpbench") / "inductor"
