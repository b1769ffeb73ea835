"""train.compile: each transformer block compiled on its own (by inductor, or the backend
train.compile_backend names), as torchtitan's regional compile (`apply_compile`: per block,
fullgraph, after TP and recompute, before DP wraps the model), so the repeated structure compiles
once and the embedding and head stay eager. Every engine and DP level compiles the same way:
tpbench's own engine and DTensor's blocks once sharded, DDP's dense blocks before DDP wraps them,
ZeRO-1 and FSDP2 over the compiled blocks.

Inductor's on-disk caches (its FX graph cache and AOTAutograd's) live in one folder kept across runs,
`inductor_cache()`: $TPBENCH_CACHE_DIR/inductor (default ~/.cache/tpbench/inductor), unless
TORCHINDUCTOR_CACHE_DIR names another; a run whose blocks were compiled before, by any run of the
same shapes, reads its kernels back instead of compiling them (a cold cache costs `first_step_s`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from tpbench import machine
from tpbench.models.dropout import PositionalDropout
from tpbench.models.minimind import MiniMindForCausalLM
from tpbench.results import Measurement, RankResult


def apply_compile(
    model: MiniMindForCausalLM, between_linears: bool = False, backend: str = "inductor"
) -> None:
    """train.compile: each block compiled on its own, in place, as torchtitan does (the names of the
    parameters stay). fullgraph: a graph break is an error, not a silent fallback to eager. The blocks'
    collectives go into the graph as tpbench's registered custom ops (tpbench.parallel.comm), so they
    are counted as without compile. The blocks share one compiled graph (their parameters are its
    inputs). Graphs compiled earlier in this process, for another model, are dropped first (a test
    launch builds many), so that each model compiles within Dynamo's recompile limit, and Dynamo's
    counters restart. Each graph Dynamo makes while this model runs is counted as its own
    (`Graphs`: validate reports them, `record_graphs`).

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
    place_dropout_keys(model)
    if not isinstance(getattr(model, "compile_graphs", None), Graphs):
        model.compile_graphs = Graphs()
        model.register_forward_pre_hook(model.compile_graphs.enter)
    compiler = BACKENDS[backend]
    for block in model.model.layers:
        if not between_linears:
            block.compile(fullgraph=True, backend=compiler)
            continue
        attn, mlp = block.self_attn, block.mlp
        head_norms = (attn.q_norm, attn.k_norm) if attn.qk_norm else ()
        for norm in (block.input_layernorm, block.post_attention_layernorm, *head_norms):
            norm.compile(fullgraph=True, backend=compiler)
        mlp.act = torch.compile(mlp.act, fullgraph=True, backend=compiler)


class Graphs:
    """The graphs Dynamo made of one model's compiled blocks, counted as inductor gets each (whichever
    step that is: the DTensor engine's first step runs eager, its graphs come at the second), and the
    validate figures that say them (`record_graphs`), kept up to date."""

    running: Graphs | None = None  # the compiled model whose forward runs (set by its pre-hook)

    def __init__(self) -> None:
        self.count = 0
        self.figures: list[tuple[Measurement, Measurement]] = []

    def enter(self, _module: torch.nn.Module, _args: tuple) -> None:
        Graphs.running = self

    def made(self) -> None:
        self.count += 1
        self.write()

    def write(self) -> None:
        from torch._dynamo.utils import counters

        breaks = float(sum(counters["graph_break"].values()))  # fullgraph: a break fails instead
        for graphs, graph_breaks in self.figures:
            graphs.value, graph_breaks.value = float(self.count), breaks


def _inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor, as backend="inductor" compiles, each graph counted to the model running. One function
    for every block: Dynamo reuses a graph only under the backend that made it."""
    from torch._inductor.compile_fx import compile_fx

    if Graphs.running is not None:
        Graphs.running.made()
    return compile_fx(gm, example_inputs)


def _aot_eager(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """torch's aot_eager backend, each graph counted as `_inductor` counts it."""
    from torch._dynamo import lookup_backend

    if Graphs.running is not None:
        Graphs.running.made()
    return lookup_backend("aot_eager")(gm, example_inputs)


BACKENDS = {"inductor": _inductor, "aot_eager": _aot_eager}  # train.compile_backend


def record_graphs(model: MiniMindForCausalLM, result: RankResult) -> None:
    """Validate's compile_graphs (the graphs Dynamo made of this model's compiled blocks: at least one)
    and compile_graph_breaks (0: fullgraph), written again as later steps make more, so the run
    reports every graph of its steps (DTensor's first step, which counts the collectives, runs eager)."""
    graphs: Graphs = model.compile_graphs
    result.add("compile_graphs", graphs.count)
    result.add("compile_graph_breaks", 0)
    graphs.figures.append((result.measurements[-2], result.measurements[-1]))
    graphs.write()


def place_dropout_keys(model: MiniMindForCausalLM) -> None:
    """model.dropout: the key and each site as tensors on the model's device, a compiled block's
    inputs (tpbench.models.dropout.DropoutKey), so that a step's new key recompiles nothing."""
    device = next(model.parameters()).device
    model.model.dropout_key.place(device)
    for module in model.modules():
        if isinstance(module, PositionalDropout):
            module.place(device)


def inductor_cache() -> Path:
    """The folder of inductor's on-disk caches, beside tpbench's other caches (rates.json)."""
    return machine.cache_dir() / "inductor"
