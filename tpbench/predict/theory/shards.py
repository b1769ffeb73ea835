"""FSDP2's and ZeRO-1's shards of one rank's parameters (tpbench.predict.theory.sharding's geometry):
each parameter's dim 0, its FSDP2 unit (a block or the root), and the elements of a padded shard.
Derived from the rank's tensors (tpbench.predict.theory.weights), nothing fitted."""

from __future__ import annotations

import functools
import math

from tpbench.predict.theory.dims import Dims
from tpbench.predict.theory.weights import late_params, params

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


@functools.lru_cache(maxsize=64)
def zero_buckets(d: Dims, D: int) -> tuple[tuple[int, bool], ...]:
    """(elements padded to a multiple of D, late) of each of ZeRO-1's buckets (tpbench.parallel.zero),
    in bucket order: the parameters in reverse module order, a bucket closed once it holds
    `Dims.zero_bucket` elements, then the late ones (`late_params`: a TP gradient sum to see first,
    the tied embedding) in one. Cached: `fit` asks for a deep model's many times."""
    late = late_params(d)
    out, size = [], 0
    for name, n in reversed(params(d)):
        if name in late:
            continue
        size += n
        if size >= d.zero_bucket:
            out.append((math.ceil(size / D) * D, False))
            size = 0
    if size:
        out.append((math.ceil(size / D) * D, False))
    tail = sum(n for name, n in params(d) if name in late)
    if tail:
        out.append((math.ceil(tail / D) * D, True))
    return tuple(out)


def flat_shard(d: Dims, D: int) -> int:
    """Elements of this rank's pieces of ZeRO-1's buckets, all of them: 1/D of each padded bucket."""
    return sum(n for n, _ in zero_buckets(d, D)) // D


@functools.lru_cache(maxsize=64)
def unit_shards(d: Dims, D: int) -> dict[str, int]:
    """Elements of each unit's shard on this rank; D times it are its gathered parameters, each
    padded to D x its shard, as FSDP2 allocates them. Cached as `units`: read it, never change it."""
    return {u: sum(dim0_shard(r, c, D) for _, r, c in ps) for u, ps in units(d).items()}
