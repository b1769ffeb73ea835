"""`tpbench fit`'s search: every layout of a model on a cluster, each at its largest micro-batch that
fits, its memory from the analytic model (tpbench.predict.theory) and its step time from the time model
(tpbench.predict.steptime); tpbench.sizing.fit says what each figure is."""

from __future__ import annotations

import dataclasses

from tpbench.config import ConfigError, RunConfig
from tpbench.models.shapes import model_name, shape_label
from tpbench.predict import steptime, theory
from tpbench.predict.hardware import GPU
from tpbench.predict.theory import reserved, sharding
from tpbench.run import compose
from tpbench.sizing import defaults
from tpbench.sizing.layouts import (
    LEVELS,
    RECOMPUTE,
    Fit,
    FitError,
    GiB,
    Memory,
    Overheads,
    Row,
    configure,
)

MAX_MICRO_BATCH = 256
DP_SYNC = (sharding.GRADS, sharding.PARAMS)  # the purposes of DP's collectives
MAX_NODES = 4096  # how far the nothing-fits line looks for a node count
HSDP_NODES = (1, 2, 4)  # the nodes an HSDP shard group spans
# Between nodes: one 400 Gb/s NIC per GPU (InfiniBand NDR, a DGX H100's ConnectX-7 per GPU), of which
# a ring collective is assumed to reach 80% (an assumption, not a cited measurement): settable
# (--network-gbps)
NETWORK_GBPS, NETWORK_FRACTION = 400.0, 0.8


class NothingFits(Exception):
    """No layout fits: the answer is one line (`line`), with the search's rows (`fit`) beside it; not
    bad input (FitError), so `tpbench fit` exits 1 with it, not 2."""

    def __init__(self, line: str, fit: Fit) -> None:
        super().__init__(line)
        self.line, self.fit = line, fit


FITS_NO_LAYOUT = "fits no layout"  # the words of every nothing-fits line


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: GPU
    nodes: int
    gpus_per_node: int
    memory: Memory
    overheads: Overheads = Overheads()
    network_gbps: float = NETWORK_GBPS

    def network_rates(self, rates: steptime.Rates) -> steptime.Rates:
        """`rates` with every collective at the network's bandwidth: DP's between nodes."""
        beta = 1 / (self.network_gbps / 8 * 1e9 * NETWORK_FRACTION)
        return dataclasses.replace(rates, beta=dict.fromkeys(rates.beta, beta))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def tensor_parallel(base: RunConfig, gpus_per_node: int, given: set[str]) -> list[int]:
    """Every T within a node that divides the heads; the given one alone (refused when not among them)."""
    m, p = base.model, base.parallel
    tps = [
        T for T in range(1, gpus_per_node + 1) if gpus_per_node % T == 0 and m.num_attention_heads % T == 0
    ]
    if "parallel.tp" in given:
        if p.tp not in tps:
            raise FitError(
                f"parallel.tp={p.tp}: fit takes T dividing gpus_per_node={gpus_per_node} and the "
                f"{m.num_attention_heads} heads: {', '.join(map(str, tps))}"
            )
        tps = [p.tp]
    return tps


def shardings(base: RunConfig, dp: int, nodes: int, given: set[str]) -> list[tuple[str, int]]:
    """(dp_shard, dp_replicate) of DP ranks: DDP alone at DP 1; else each level, and FSDP's levels with
    HSDP's replicas across nodes: shard groups of one, two or four whole nodes (HSDP_NODES), R of them,
    each of dp / R >= 2 ranks (pruned: the other divisors of the nodes add rows between these)."""
    p = base.parallel
    levels = [p.dp_shard] if "parallel.dp_shard" in given else list(LEVELS)
    out = []
    for level in levels if dp > 1 else [lvl for lvl in levels if lvl == "none"]:
        replicas = [1]
        if level in ("grads", "full"):
            spans = [s for s in HSDP_NODES if nodes % s == 0 and nodes // s > 1]
            replicas += [nodes // s for s in spans if dp % (nodes // s) == 0 and dp // (nodes // s) >= 2]
        if "parallel.dp_replicate" in given:
            replicas = [p.dp_replicate] if p.dp_replicate in replicas else []
        out += [(level, r) for r in replicas]
    return out


def search(
    base: RunConfig,
    cluster: Cluster,
    given: set[str],
    global_batch: int | None = None,
    max_micro_batch: int = MAX_MICRO_BATCH,
    explain: bool = True,
) -> Fit:
    """Every layout of `base`'s model on `cluster`: T within a node x DP (the rest of the GPUs) x DP
    sharding (and HSDP's replicas) x SP x VP x recompute, each at its largest micro-batch that fits.
    `given`: the keys the user set among the searched ones: the search keeps to base's value of those.
    With `explain`, nothing fitting is a FitError naming the node count that would fit."""
    m, t = base.model, base.train
    if t.seq_len > m.max_position_embeddings:
        raise FitError(
            f"train.seq_len={t.seq_len}: {m.name} allows up to model.max_position_embeddings="
            f"{m.max_position_embeddings} positions"
        )
    rates = steptime.gpu_rates(cluster.gpu, t.dtype)
    timing = (rates, cluster.network_rates(rates), cluster)
    rows: list[Row] = []
    for T in tensor_parallel(base, cluster.gpus_per_node, given):
        dp = cluster.gpus // T
        batches = micro_batches(base, dp, global_batch, given, max_micro_batch)
        if not batches:
            continue
        modes = [(False, False)] if T == 1 else [(s, v) for s in (False, True) for v in (False, True)]
        for sp, vp in modes:
            if ("parallel.sp" in given and sp != base.parallel.sp) or (
                "parallel.vp" in given and vp != base.parallel.vp
            ):
                continue
            for level, replicas in shardings(base, dp, cluster.nodes, given):
                # pruned: less recompute holds more, so nothing fits once full does not (op is no
                # bound on selective: under SP it keeps the gathered inputs whole, selective their shard)
                leanest = None
                for recompute in [t.recompute] if "train.recompute" in given else RECOMPUTE[::-1]:
                    row = Row(T, sp, vp, recompute, batches[0], dp, level, replicas)
                    if leanest is not None:
                        rows.append(dataclasses.replace(row, reason=f"pruned: {leanest} does not fit"))
                        continue
                    rows.append(_largest(base, cluster, row, batches, global_batch, timing))
                    if not rows[-1].reason and not rows[-1].fits and recompute != "op":
                        leanest = f"recompute {recompute} at micro-batch {batches[0]}"
    if not rows:
        raise FitError(no_layout(base, cluster, given, global_batch))
    fit = Fit(
        base,
        cluster.gpu,
        cluster.nodes,
        cluster.gpus_per_node,
        global_batch,
        cluster.overheads,
        cluster.memory,
        rows,
        dataclasses.asdict(rates)
        | {"network_gbps": cluster.network_gbps, "network_fraction": NETWORK_FRACTION},
    )
    if explain and not fit.fitting:
        raise NothingFits(nothing_fits(base, cluster, given, global_batch, fit), fit)
    return fit


def rates(fit: Fit) -> steptime.Rates:
    """The rates a search timed its rows at."""
    return steptime.gpu_rates(fit.gpu, fit.base.train.dtype)


def no_layout(base: RunConfig, cluster: Cluster, given: set[str], global_batch: int | None) -> str:
    """Why the overrides leave no layout at all, in one line naming the value and what is accepted."""
    p, b = base.parallel, base.train.micro_batch
    dps = [cluster.gpus // T for T in tensor_parallel(base, cluster.gpus_per_node, given)]
    if "parallel.dp_replicate" in given:
        hsdp = sorted(
            {
                r
                for dp in dps
                for _, r in shardings(base, dp, cluster.nodes, given - {"parallel.dp_replicate"})
            }
        )
        return (
            f"parallel.dp_replicate={p.dp_replicate}: on {cluster.nodes} node(s) fit takes HSDP replicas "
            f"{', '.join(map(str, hsdp))} (1: no HSDP) with dp_shard=grads or full"
        )
    if global_batch is not None and "train.micro_batch" in given:
        return (
            f"train.micro_batch={b} with global_batch={global_batch}: accepted are micro-batches dividing "
            f"global_batch / DP, DP of {', '.join(map(str, dps))}"
        )
    if global_batch is not None:
        return f"global_batch={global_batch}: accepted are multiples of DP, here {', '.join(map(str, dps))}"
    return (
        f"parallel.dp_shard={p.dp_shard}: nothing to shard at DP {', '.join(map(str, dps))}; accepted is none"
    )


def micro_batches(
    base: RunConfig, dp: int, global_batch: int | None, given: set[str], max_micro_batch: int
) -> list[int]:
    """The micro-batches of a DP: the divisors of global_batch / DP (none where DP does not divide it),
    else 1 to max_micro_batch; the given one alone."""
    if global_batch is not None:
        if global_batch % dp:
            return []
        local = global_batch // dp
        batches = [b for b in range(1, local + 1) if local % b == 0]
    else:
        batches = list(range(1, max_micro_batch + 1))
    if "train.micro_batch" in given:
        b = base.train.micro_batch
        return [b] if b in batches or global_batch is None else []
    return batches


def nothing_fits(
    base: RunConfig, cluster: Cluster, given: set[str], global_batch: int | None, fit: Fit
) -> str:
    """The one line of a search where nothing fits: the least peak, the tight rows if any, and the fewest
    nodes on which a layout with every pinned choice fits (or that none does, or that this model at this
    seq needs pipeline or context parallelism). A search whose rows cannot run at all is bad input."""
    m, t, gpu = base.model, base.train, cluster.gpu
    runnable = [r for r in fit.rows if not r.reason]
    if not runnable and fit.rows:
        raise FitError(f"{model_name(m)}: no layout can run ({fit.rows[0].reason})")
    if not runnable:
        raise FitError(f"global_batch={global_batch}: splits over no DP here; accepted are multiples of DP")
    pins = pinned(base, given)
    here = (
        f"{model_name(m)} ({shape_label(m)}) at S {t.seq_len} ({t.precision} precision, "
        f"{defaults.optimizer_words(base)}) {FITS_NO_LAYOUT}"
        f"{f' with {pins}' if pins else ''} on {cluster.nodes} node(s) of {cluster.gpus_per_node} "
        f"{gpu.name} ({cluster.memory.usable_bytes / GiB:.1f} GiB usable, {cluster.memory.margin:.0%} margin)"
    )
    least = min(runnable, key=lambda r: r.peak_bytes)
    here += f", the least per-rank peak {least.peak_bytes / GiB:,.1f} GiB ({least.label()})"
    if fit.tight:
        n = len(fit.tight)
        runs = f"{n} layouts run" if n > 1 else "1 layout runs"
        here += f"; {runs} tight, under the margin (the tight table; --margin 0 fits them)"
    nodes = cluster.nodes * 2
    while nodes <= MAX_NODES:
        more = dataclasses.replace(cluster, nodes=nodes)
        for T in tensor_parallel(base, cluster.gpus_per_node, given):
            lean = leanest(base, more, given, global_batch, T)
            if lean is not None and lean.fits:
                sharded = " with sharded DP" if lean.dp_shard != "none" else ""
                gpus = nodes * cluster.gpus_per_node
                return f"{here}: fits on {nodes} nodes ({gpus} GPUs){sharded}, e.g. {lean.label()}"
        nodes *= 2
    widest = dataclasses.replace(cluster, nodes=MAX_NODES)  # unpinned, where it holds the least
    unpinned = (
        leanest(base, widest, set(), None, T) for T in tensor_parallel(base, cluster.gpus_per_node, set())
    )
    if pins and any(row is not None and row.fits for row in unpinned):
        return f"{here}: nothing with {pins} fits on up to {MAX_NODES} nodes"
    return (
        f"{here}: nothing fits on up to {MAX_NODES} nodes even sharded over every GPU: {m.name} at S "
        f"{t.seq_len} needs pipeline or context parallelism, which tpbench does not do"
    )


def pinned(base: RunConfig, given: set[str]) -> str:
    """The searched choices the overrides fix, as they would be typed: `tp=2 sp=true recompute=full`."""
    values = {
        "parallel.tp": base.parallel.tp,
        "parallel.sp": base.parallel.sp,
        "parallel.vp": base.parallel.vp,
        "parallel.dp_shard": base.parallel.dp_shard,
        "parallel.dp_replicate": base.parallel.dp_replicate,
        "train.recompute": base.train.recompute,
        "train.micro_batch": base.train.micro_batch,
    }
    short = {full: name for name, full in compose.SHORT_NAMES.items()}
    said = [
        f"{short.get(key, key)}={str(v).lower() if isinstance(v, bool) else v}"
        for key, v in values.items()
        if key in given
    ]
    return " ".join(said)


def leanest(
    base: RunConfig, cluster: Cluster, given: set[str], global_batch: int | None, T: int
) -> Row | None:
    """The layout of T on `cluster` that holds the least, its memory evaluated: SP and VP, DP sharded
    over every rank (FSDP), full recompute, the least micro-batch; each pinned choice as pinned. None
    where the pins leave T no layout there."""
    p, t = base.parallel, base.train
    dp = cluster.gpus // T
    sp = p.sp if "parallel.sp" in given else T > 1
    vp = p.vp if "parallel.vp" in given else T > 1
    levels = shardings(base, dp, cluster.nodes, given)
    batches = micro_batches(base, dp, global_batch, given, 1)
    if (T == 1 and (sp or vp)) or not levels or not batches:
        return None
    level, replicas = max(levels, key=lambda lr: (LEVELS.index(lr[0]), -lr[1]))
    recompute = t.recompute if "train.recompute" in given else "full"
    row = _with(Row(T, sp, vp, recompute, batches[0], dp, level, replicas), batches[0], global_batch)
    try:
        compose.check(configure(base, row))
    except ConfigError:
        return None
    return _memory(base, cluster, row)


def _largest(
    base: RunConfig, cluster: Cluster, row: Row, batches: list[int], global_batch: int | None, timing
) -> Row:
    """The row at the largest of `batches` that fits, its step timed. Memory grows with the micro-batch,
    each moment linearly (activations) and the peak as their maximum, a convex function: the line
    through the first two batches' peaks bounds it from below, so the batch where that line reaches the
    budget bounds the answer from above; the search halves the interval between (about four
    evaluations of the memory model a layout instead of a dozen)."""
    try:
        compose.check(configure(base, row))
    except ConfigError as e:
        return dataclasses.replace(row, reason=str(e))
    at = lambda i: _memory(base, cluster, _with(row, batches[i], global_batch))  # noqa: E731
    low = at(0)
    if not low.fits:
        return _timed(base, low, timing)
    lo, hi = 0, len(batches)  # batches[lo] fits; hi: the first index known not to fit
    if len(batches) > 1:
        second = at(1)
        if not second.fits:
            hi = 1
        else:
            slope = (second.peak_bytes - low.peak_bytes) / (batches[1] - batches[0])
            lo, low = 1, second
            budget = cluster.memory.usable_bytes - cluster.memory.margin_bytes - second.peak_bytes
            bound = batches[1] + budget / slope if slope > 0 else float("inf")
            hi = next((i for i, b in enumerate(batches) if b > bound), len(batches))
            hi = max(hi, 2)
            if hi - 1 > lo:  # the bound itself is the likeliest answer: try it first
                guess = at(hi - 1)
                if guess.fits:
                    lo, low = hi - 1, guess
                else:
                    hi = hi - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        candidate = at(mid)
        lo, low, hi = (mid, candidate, hi) if candidate.fits else (lo, low, mid)
    searched = len(batches) > 1 and global_batch is None  # a given micro-batch is that, not a minimum
    return dataclasses.replace(_timed(base, low, timing), capped=searched and lo == len(batches) - 1)


def _with(row: Row, micro_batch: int, global_batch: int | None) -> Row:
    accumulation = global_batch // (row.dp * micro_batch) if global_batch is not None else 1
    return dataclasses.replace(row, micro_batch=micro_batch, accumulation=accumulation)


def _memory(base: RunConfig, cluster: Cluster, row: Row) -> Row:
    """One row's memory: the per-rank peak of its step of `row.accumulation` micro-steps (its last
    micro-step's, beside what the earlier ones leave: theory.accumulation.step_moments), the predicted
    max reserved it needs (tpbench.predict.theory.reserved: with FSDP2's stream pools) and its
    headroom by that, on the GPU itself as `plan` predicts it (launch.emulate=none: fit's base emulates a rank
    for --measure, and an emulated rank runs torch's CPU-build loss, which copies the logits to fp32
    where CUDA's fused one does not). Its collective bytes are one micro-step's."""
    cfg = configure(base, row)
    on_the_gpu = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, emulate="none"))
    train = dataclasses.replace(on_the_gpu.train, accumulation=row.accumulation)
    prediction = theory.predict(dataclasses.replace(on_the_gpu, train=train))
    allocated = prediction.max_memory_allocated_bytes(cluster.gpu.name)
    reserve = reserved.reserved(on_the_gpu, prediction, cluster.gpu.name).total
    overhead = cluster.overheads.nccl_bytes_per_communicator * communicators(cfg)
    peak = reserve + overhead
    return dataclasses.replace(
        row,
        peak_bytes=peak,
        live_bytes=prediction.peak_bytes,
        moment=prediction.peak.name,
        allocated_bytes=allocated,
        reserved_bytes=reserve,
        overhead_bytes=overhead,
        headroom_bytes=cluster.memory.usable_bytes - peak,
        margin_bytes=cluster.memory.margin_bytes,
        comm_bytes_per_step=sum(r.bytes for r in theory.comm_rows(on_the_gpu)),
    )


def _timed(base: RunConfig, row: Row, timing) -> Row:
    """The row's whole step: its time, tokens/s per GPU, MFU and FLOPs. DP's collectives run at the
    network's rates where their group spans nodes: all of them, but under HSDP with its shard group
    within one node, where only the all-reduce between the replicas (on other nodes by construction)
    does; the rest at the GPU's."""
    rates, network, cluster = timing
    cfg = configure(base, row)
    timed = steptime.predict_time(cfg, rates)
    within = row.dp_replicate > 1 and row.dp // row.dp_replicate * row.tp <= cluster.gpus_per_node
    if cluster.nodes > 1 and row.dp > 1:
        if within:  # the shard group's gathers and reduce-scatters on NVLink, the replicas' all-reduce not
            network = dataclasses.replace(
                rates, beta={**rates.beta, "all_reduce": network.beta["all_reduce"]}
            )
        across = steptime.predict_time(cfg, network)
        for purpose in DP_SYNC:
            if purpose in across.comm_exposed:
                timed.comm_exposed[purpose] = across.comm_exposed[purpose]
    step_s, host_bound = step_time(timed, row)
    tokens = row.micro_batch * row.dp * row.accumulation * cfg.train.seq_len
    model_flops = theory.model_flops_per_step(cfg) * row.accumulation
    return dataclasses.replace(
        row,
        step_s=step_s,
        host_bound=host_bound,
        tokens_per_step=tokens,
        tokens_per_s_per_gpu=tokens / step_s / row.gpus,
        mfu=model_flops / (step_s * row.gpus * rates.peak),
        recompute_flops_per_step=theory.recompute_flops_per_step(cfg) * row.accumulation,
        model_flops_per_step=model_flops,
    )


def evaluate(base: RunConfig, cluster: Cluster, row: Row) -> Row:
    """One row at its micro-batch: its memory and its step's time."""
    rates = steptime.gpu_rates(cluster.gpu, base.train.dtype)
    return _timed(base, _memory(base, cluster, row), (rates, cluster.network_rates(rates), cluster))


def step_time(timed: steptime.TimePrediction, row: Row) -> tuple[float, bool]:
    """The optimizer step of `row.accumulation` micro-steps: each micro-step's compute and exposed
    communication, then (DDP, ZeRO-1) one DP gradient sync, and the optimizer; FSDP's levels (grads,
    full) sync every micro-step (layouts.ACCUMULATION). The host's issue time instead where it is
    longer (each micro-step's ops, the optimizer's once), and whether it is."""
    once = 0.0 if row.dp_shard in ("grads", "full") else sum(timed.comm_exposed.get(p, 0.0) for p in DP_SYNC)
    micro = timed.compute_s + timed.comm_s - once
    device = row.accumulation * micro + once + timed.optimizer_s
    host = row.accumulation * (timed.host_s - timed.host_optimizer_s) + timed.host_optimizer_s
    return max(device, host), host > device


def communicators(cfg: RunConfig) -> int:
    """NCCL communicators of one rank: the world's, its TP group's, its DP group's (HSDP: its shard and
    replica groups') and its KV-replica group's (T > N_kv), each of more than one rank."""
    p = cfg.parallel
    T, dp, kv = p.tp, p.dp, cfg.model.num_key_value_heads
    hsdp = p.dp_replicate > 1
    return sum((T * dp > 1, T > 1, dp > 1, hsdp, T > kv))
