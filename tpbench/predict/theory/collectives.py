"""Collectives: what tpbench.parallel.instrumentation.CommCounter counts on one rank per training
step, by op and purpose: each collective's count and its ring bytes (the counter's own `ring_bytes`).
The counts per mode are in docs/theory.md, "Communication per step".
"""

from __future__ import annotations

import math

from tpbench.config import RunConfig
from tpbench.parallel.instrumentation import ring_bytes
from tpbench.predict.theory.dims import FP32, Dims, dims
from tpbench.predict.theory.sharding import GRADS, PARAMS, level_dims, sharding
from tpbench.predict.theory.shards import unit_shards, zero_buckets
from tpbench.predict.theory.weights import ddp_buckets, flat_dp_buckets, params
from tpbench.results import CommRow


def comm_rows(cfg: RunConfig) -> list[CommRow]:
    """(op, purpose, count, bytes) of one training step on one rank, as CommCounter counts them."""
    s = sharding(cfg)
    sharded = s.sharded
    d = level_dims(cfg) if sharded else dims(cfg)
    rows: dict[tuple[str, str], list[int]] = {}

    def add(op: str, purpose: str, full_bytes: int, world: int, count: int = 1) -> None:
        if world > 1 and count > 0:
            row = rows.setdefault((op, purpose), [0, 0])
            row[0] += count
            row[1] += count * ring_bytes(op, full_bytes, world)  # the counter's own formula

    skip = set(cfg.debug.skip_grad_sum)
    if d.ddp:
        cap = int(cfg.parallel.ddp_bucket_mb * 2**20)
        for size in ddp_buckets(d, cap, rebuilt=cfg.train.warmup > 0):
            add("all_reduce", "dp_grads", size, d.dp)
        return _sorted(rows)

    T, L, N, H = d.T, d.L, d.N, d.H
    # Element bytes: `a` of what crosses a region's boundary (its entry's input, cast to the autocast
    # dtype under mixed precision, a row-parallel output, their gradients); `e` of the stream at the
    # edges (the embedding's output, the replicated head's input), fp32 under mixed precision, save
    # under a sharded level, whose weights, and so the embedding's output, are in the autocast dtype.
    a, e = d.p, d.p if sharded else d.s
    g = d.entries  # entries per block: 2 regions, or SP's 5 column linears (sp_gather=linear)
    regions, vp = g * L + (1 if d.vp else 0), 1 if d.vp else 0  # entries per block, the VP head
    if not d.sp:  # f-bar forward at 2L exits, f backward at every entry; VP: the embedding's f-bar
        add("all_reduce", "activation", N * H * a, T, 2 * L + regions)
        add("all_reduce", "activation", N * H * e, T, vp)
    else:  # g all-gathers forward, reduce-scatters backward; g-bar the other way round
        add("all_gather", "activation", N * H * a, T, regions + 2 * L)
        add("reduce_scatter", "activation", N * H * a, T, regions + 2 * L)
        # the embedding: VP's g-bar (reduce-scatter, all-gather backward), else the split's backward
        # all-gather; without VP, the replicated head's all-gather
        add("all_gather", "activation", N * H * e, T, 1 if d.vp else 2)
        add("reduce_scatter", "activation", N * H * e, T, vp)
        if d.regather:  # backward all-gathers each saved shard again: g per block, + the VP head
            add("all_gather", "regather", N * H * a, T, (g * L if d.block_regather else 0) + vp)
    # Each block's forward again, to its last save: every entry (SP: g) and the attention's exit
    # (dropout: to the MLP's mask, its exit too), under full; under op on the dtensor engine, what
    # the policy does not keep, the functional all-gathers and all-reduces (its reduce-scatters are
    # kept, and tpbench's engine keeps every collective of its own)
    if d.recompute == "full" or (d.recompute == "op" and d.dtensor):
        exits = 2 if d.dropout else 1
        if d.sp:
            add("all_gather", "recompute", N * H * a, T, g * L)
            add("reduce_scatter", "recompute", N * H * a, T, exits * L * (d.recompute == "full"))
        else:
            add("all_reduce", "recompute", N * H * a, T, exits * L)
    if d.vp and not d.logits_mean:  # the loss: max, target logit, sum of exp, [S, B] fp32 each
        add("all_reduce", "loss", N * FP32, T, 3)
    if T > 1:
        # under FSDP2 the sums run on the DP shards of those gradients (dim 0: ceil(rows / D) rows)
        dp_rows_of = (lambda r: math.ceil(r / s.D)) if s.fsdp else (lambda r: r)  # noqa: E731
        tp_sums = (2 * L * dp_rows_of(d.D) if d.qk_norm and "qk_norm" not in skip else 0) + (
            (2 * L + 1) * dp_rows_of(H) if d.sp and "sp_norms" not in skip else 0
        )  # q/k norm weights (each rank saw its heads), SP norms (each rank saw its tokens)
        if tp_sums:
            add("all_reduce", "grad_sum", tp_sums * d.w, T)
        if d.Nkv % T and "kv_replicas" not in skip:  # ranks sharing one KV head sum k/v grads
            add("all_reduce", "grad_sum", 2 * L * dp_rows_of(d.D) * (H + d.bias) * d.w, T // d.Nkv)
    if "dp" not in skip and sharded:  # ZeRO-1, ZeRO-2, FSDP (tpbench.predict.theory.sharding)
        for op, purpose, full, world, count in dp_rows(cfg, d):
            add(op, purpose, full, world, count)
    elif "dp" not in skip and d.flat_dp:  # overlap: one all-reduce per flat bucket
        for size in flat_dp_buckets(d, cfg.parallel.ddp_bucket_mb * 2**20):
            add("all_reduce", "dp_grads", size, d.dp)
    elif "dp" not in skip:
        add("all_reduce", "dp_grads", sum(n for _, n in params(d)) * d.w, d.dp)
    if d.grad_clip:  # the global norm's squares (an fp32 scalar) over TP, then the DP shard group
        add("all_reduce", "grad_norm", FP32, T)
        add("all_reduce", "grad_norm", FP32, s.D if sharded else 1)
    return _sorted(rows)


def _sorted(rows: dict[tuple[str, str], list[int]]) -> list[CommRow]:
    return [CommRow(op, purpose, n, b) for (op, purpose), (n, b) in sorted(rows.items())]


def dp_rows(cfg: RunConfig, d: Dims) -> list[tuple[str, str, int, int, int]]:
    """(op, purpose, full bytes, world, count) of each DP collective of a step under a sharded level:
    ZeRO-1 reduce-scatters each bucket of its gradient buffer and all-gathers each of its parameter
    buffer once; FSDP2
    reduce-scatters each unit's gradients once and all-gathers each unit's parameters once a step
    (ZeRO-2) or twice (ZeRO-3: forward and backward, as counted at DP 2). Under
    HSDP each reduce-scatter's output is all-reduced across the R replicas."""
    s = sharding(cfg)
    w, D, R = d.w, s.D, s.replicate
    pw = d.p if d.mixed else w  # the weights gathered in the compute dtype, the gradients reduced in w's
    out = []
    if s.level == "optimizer":  # one of each per bucket (HSDP's replicas are refused for ZeRO-1)
        for n, _ in zero_buckets(d, D):
            out += [("reduce_scatter", GRADS, n * w, D, 1), ("all_gather", PARAMS, n * pw, D, 1)]
        return out
    for n in unit_shards(d, D).values():
        again = 2 if s.level == "full" else 1  # the root too: gathered again at backward's start
        out += [("all_gather", PARAMS, D * n * pw, D, again), ("reduce_scatter", GRADS, D * n * w, D, 1)]
        out.append(("all_reduce", GRADS, n * w, R, 1))
    return out
