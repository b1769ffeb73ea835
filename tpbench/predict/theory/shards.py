"""FSDP2's and ZeRO-1's shards of one rank's parameters (tpbench.predict.theory.sharding's geometry):
each parameter's dim 0, its FSDP2 unit (a block or the root), and the elements of a padded shard.
Derived from the rank's tensors (tpbench.predict.theory.weights), nothing fitted."""

from __future__ import annotations

import functools
import math

from tpbench.predict.theory.dims import Dims
from tpbench.predict.theory.weights import params

ROOT = "root"  # FSDP2's root unit: the embedding, the final norm and the LM head


def rows(d: Dims, name: str) -> int:
    """Dim 0 of a parameter on this rank (what FSDP2 shards): a linear's output width, a norm's or a
    bias's length, the vocab rows of the embedding and the LM head."""
    if name in ("model.embed_tokens", "lm_head"):
        return d.V_l
    leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    widths = {
        "self_attn.q_proj": d.Hq,
        "self_attn.k_proj": d.Hkv,
        "self_attn.v_proj": d.Hkv,
        "self_attn.o_proj": d.H,
        "self_attn.q_norm": d.D,
        "self_attn.k_norm": d.D,
        "mlp.gate_proj": d.I_l,
        "mlp.up_proj": d.I_l,
        "mlp.down_proj": d.H,
    }
    return widths.get(leaf.removesuffix(".bias"), d.H)


def unit_of(name: str) -> str:
    """FSDP2's unit of a parameter: its block (`layers.i`), or the root."""
    return ".".join(name.split(".")[1:3]) if name.startswith("model.layers.") else ROOT


@functools.lru_cache(maxsize=64)
def units(d: Dims) -> dict[str, list[tuple[str, int, int]]]:
    """(name, rows, columns) of each unit's parameters on this rank, the root first, then the blocks.
    Cached (a Dims is frozen; `fit` asks for a deep model's hundreds of times): read it, never change it."""
    out: dict[str, list[tuple[str, int, int]]] = {ROOT: []}
    for name, n in params(d):
        r = rows(d, name)
        out.setdefault(unit_of(name), []).append((name, r, n // r))
    return out


def dim0_shard(r: int, cols: int, D: int) -> int:
    """Elements of FSDP2's padded shard of a [r, cols] parameter: ceil(r / D) rows (rank 0's, the
    busiest: the last ranks' may be shorter or empty, their padding kept in the same storage)."""
    return math.ceil(r / D) * cols


def flat_shard(d: Dims, D: int) -> int:
    """Elements of ZeRO-1's slice: the flat buffer of every parameter, padded to a multiple of D."""
    return math.ceil(sum(n for _, n in params(d)) / D)


@functools.lru_cache(maxsize=64)
def unit_shards(d: Dims, D: int) -> dict[str, int]:
    """Elements of each unit's shard on this rank; D times it are its gathered parameters, each
    padded to D x its shard, as FSDP2 allocates them. Cached as `units`: read it, never change it."""
    return {u: sum(dim0_shard(r, c, D) for _, r, c in ps) for u, ps in units(d).items()}
