"""A step's time from its ops (`ops.step_ops`) and its collectives (`comm_rows`, the memory model's,
which tpbench's CommCounter checks), at the rates of the machine (`Rates`).

  op          max(FLOPs / rate of its class, bytes / bandwidth) (a GEMM's and attention's on a CPU:
              the sum; the for-loop AdamW's: its tensors once at the memory's bandwidth, its passes
              at the cache's, the larger), plus kernels x the fixed per-op cost (added on a CPU,
              where Python, dispatch and autograd run on the compute's thread; on a GPU the larger
              of the two: the host runs ahead of the kernels). A GEMM under
              launch.bf16_gemm=fp32_accumulate: at fp32's rate, its casts' bytes and kernels added,
              and every op's fixed cost with the dispatch mode's (`Rates.widen`)
  collective  count x alpha + ring bytes x beta, of its kind and group size
  overlap     a collective that the implementation runs beside compute (DDP's buckets and
              parallel.overlap's flat buckets behind backward; ZeRO-1's buckets' reduce-scatters
              behind backward and their all-gathers behind the next forward (`zero1_exposed`);
              FSDP2's units (`fsdp_exposed`); parallel.overlap's backward entry
              all-reduce / reduce-scatter behind the region's column weight gradients, SP's re-gather
              behind the row-parallel layer's and the core's backward) costs only what outlasts the
              work it hides behind, and only where it has cores of its own (`Rates.overlap`); every
              other collective adds up
  step        compute (forward, recompute, backward) + exposed communication + the optimizer

MFU = model FLOPs per step / (step time x devices x peak FLOP/s of one device), model FLOPs
= tpbench.predict.theory.model_flops_per_step: 6 x (weight-matmul FLOPs per token: 2N parameters in
the blocks' linears and the head) + the attention term 12 x L x S x H_q per token, the full S x S
products, no recompute (6N + 12 L S H). On a CPU the peak is the probed large-GEMM rate of one rank.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from tpbench.parallel.instrumentation import ring_bytes
from tpbench.predict.steptime import ops as O
from tpbench.predict.steptime.rates import Rates
from tpbench.predict.theory.dims import Dims
from tpbench.predict.theory.shards import ROOT, unit_shards, zero_buckets
from tpbench.predict.theory.weights import late_params
from tpbench.results import CommRow


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind on one rank, per step (or per block: `layer`)."""

    op: str
    purpose: str
    phase: str  # forward | backward | recompute | grads
    count: int
    bytes: float  # ring bytes, all of them
    hidden_behind: tuple[str, ...] = ()  # the ops (by name, this phase's) it may run beside


@dataclass
class TimePrediction:
    """A step's predicted time on one rank and what it is made of."""

    compute_s: float  # forward, recompute and backward ops
    optimizer_s: float
    comm_exposed: dict[str, float]  # purpose -> seconds not hidden
    comm_total_s: float  # every collective's time, hidden or not
    by_kind: dict[str, float]  # gemm, attention, elementwise, optimizer, per-op cost, collectives
    by_phase: dict[str, float]  # forward, backward (recompute and backward collectives in it), optimizer
    tokens: int = 0
    model_flops: float = 0.0
    devices: int = 1
    peak: float = 0.0
    notes: list[str] = field(default_factory=list)
    # on a GPU, the host's time to issue the step: every dispatched op and collective at
    # Rates.host_op_s (0 on a CPU, whose per-op cost is in compute_s); of it, the optimizer's
    host_s: float = 0.0
    host_optimizer_s: float = 0.0

    @property
    def comm_s(self) -> float:
        return sum(self.comm_exposed.values())

    @property
    def device_s(self) -> float:
        """The device's time: compute, exposed communication and the optimizer."""
        return self.compute_s + self.comm_s + self.optimizer_s

    @property
    def step_s(self) -> float:
        """The device's time, or the host's where issuing the step takes longer (the GPU then waits)."""
        return max(self.device_s, self.host_s)

    @property
    def host_bound(self) -> bool:
        return self.host_s > self.device_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def mfu(self) -> float | None:
        return self.model_flops / (self.step_s * self.devices * self.peak) if self.peak else None

    def fields(self) -> dict[str, float]:
        """The prediction as a throughput run's measurements (name -> value, seconds unless named)."""
        out = {
            "predicted_step_time_s": self.step_s,
            "predicted_compute_s": self.compute_s,
            "predicted_comm_exposed_s": self.comm_s,
            "predicted_optimizer_s": self.optimizer_s,
            "predicted_tokens_per_s": self.tokens_per_s,
        }
        out |= {f"predicted_comm_{purpose}_s": s for purpose, s in sorted(self.comm_exposed.items())}
        if self.host_s:
            out |= {"predicted_host_s": self.host_s, "predicted_host_bound": float(self.host_bound)}
        if self.mfu is not None:
            out["predicted_mfu"] = self.mfu
        return out


def op_time(op: O.Op, rates: Rates) -> tuple[float, float]:
    """(roofline seconds, fixed-cost seconds) of an op: on a GPU the fixed cost is what the launches
    take beyond the roofline time (zero for a kernel longer than its launch)."""
    kernels = op.kernels
    if op.kind == O.GEMM:
        roof = _kernel(op.flops / rates.gemm_rate(op.mnk), op.bytes / rates.bandwidth, rates)
        if rates.widen:  # fp32_accumulate's casts: 3 per GEMM (backward: 2 GEMMs)
            roof += rates.widen * op.bytes / rates.bandwidth
            kernels += 3 * (2 if op.phase == O.BACKWARD else 1)
    elif op.kind == O.ATTENTION:
        roof = _kernel(op.flops / rates.attention, op.bytes / rates.bandwidth, rates)
    elif op.memory_bytes is not None:  # its passes reuse operands in the cache: a two-level roofline
        roof = max(op.memory_bytes / rates.bandwidth, op.bytes / rates.cached)
    else:
        roof = op.bytes / rates.bandwidth
    fixed = kernels * rates.op_s
    return (roof, max(0.0, fixed - roof)) if rates.gpu else (roof, fixed)


def _kernel(arithmetic: float, traffic: float, rates: Rates) -> float:
    """A GEMM's or the attention kernel's time from its arithmetic and its operands' traffic: on a GPU
    the larger (its warps hide one behind the other); on a CPU the sum: one core moves the step's
    operands, which the cache no longer holds, and its result in and out beside little arithmetic
    (benchmarks/memory_bandwidth.py: H 256's GEMMs over operands made cold take their time with the
    operands in the cache plus their bytes at the memory's bandwidth, to 3%)."""
    return max(arithmetic, traffic) if rates.gpu else arithmetic + traffic


def layer_collectives(d: Dims) -> list[Collective]:
    """One block's collectives, by phase, as tpbench's engine issues them (the counts of
    tpbench.predict.theory.collectives, per block) and what parallel.overlap hides each behind."""
    if d.T == 1 or d.ddp:
        return []
    full = d.N * d.H * d.p
    ar, ag = ring_bytes("all_reduce", full, d.T), ring_bytes("all_gather", full, d.T)
    rs = ring_bytes("reduce_scatter", full, d.T)
    g = d.entries
    column = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    out = []
    if not d.sp:
        out.append(Collective("all_reduce", "activation", O.FORWARD, 2, 2 * ar))  # f-bar at the exits
        out += [Collective("all_reduce", "activation", O.BACKWARD, 1, ar, c) for c in column]  # f
    else:
        out.append(Collective("all_gather", "activation", O.FORWARD, g, g * ag))  # g at the entries
        out.append(Collective("reduce_scatter", "activation", O.FORWARD, 2, 2 * rs))  # g-bar
        out.append(Collective("all_gather", "activation", O.BACKWARD, 2, 2 * ag))  # g-bar's backward
        if g == 2:
            out += [Collective("reduce_scatter", "activation", O.BACKWARD, 1, rs, c) for c in column]
        else:
            out.append(Collective("reduce_scatter", "activation", O.BACKWARD, g, g * rs))
        if d.block_regather:
            rows = (("o_proj", "attention", "softmax", "qk^T", "pv"), ("down_proj", "swiglu"))
            if g == 2:
                out += [Collective("all_gather", "regather", O.BACKWARD, 1, ag, r) for r in rows]
            else:
                out.append(Collective("all_gather", "regather", O.BACKWARD, g, g * ag))
    if d.recompute == "full":
        exits = 2 if d.dropout else 1
        if d.sp:
            out.append(Collective("all_gather", "recompute", O.RECOMPUTE, g, g * ag))
            out.append(Collective("reduce_scatter", "recompute", O.RECOMPUTE, exits, exits * rs))
        else:
            out.append(Collective("all_reduce", "recompute", O.RECOMPUTE, exits, exits * ar))
    return out


def step_collectives(d: Dims, rows: list[CommRow]) -> list[Collective]:
    """Every collective of the step: the blocks' (L x `layer_collectives`) and the rest of `rows`
    (the memory model's comm_rows, whose totals they keep): the embedding's and the head's
    activations (half forward, half backward), the loss's (forward), the gradient sums (after
    backward: DDP's buckets and parallel.overlap's flat ones behind backward)."""
    per_layer = layer_collectives(d)
    out = [
        Collective(c.op, c.purpose, c.phase, c.count * d.L, c.bytes * d.L, c.hidden_behind) for c in per_layer
    ]
    left: dict[tuple[str, str], list[float]] = {(r.op, r.purpose): [r.count, r.bytes] for r in rows}
    for c in out:
        key = left.setdefault((c.op, c.purpose), [0, 0])
        key[0] -= c.count
        key[1] -= c.bytes
    behind_backward = ("backward",) if d.ddp or d.flat_dp else ()
    for (op, purpose), (count, size) in sorted(left.items()):
        if count <= 0:
            continue
        if purpose in ("dp_grads", "grad_sum", "grad_norm"):  # after backward (the norm: before AdamW)
            hidden = behind_backward if purpose == "dp_grads" else ()
            out.append(Collective(op, purpose, "grads", int(count), size, hidden))
        elif purpose == "loss":
            out.append(Collective(op, purpose, O.FORWARD, int(count), size))
        else:  # the embedding's and the head's: forward and backward
            half = int(count) // 2
            out.append(Collective(op, purpose, O.FORWARD, int(count) - half, size * (count - half) / count))
            if half:
                out.append(Collective(op, purpose, O.BACKWARD, half, size * half / count))
    return out


FSDP_PURPOSES = ("dp_params", "dp_grads")  # theory.sharding's PARAMS and GRADS


def fsdp_units(d: Dims) -> bool:
    """Whether FSDP2 shards the step's parameters by unit (ZeRO-2 or -3 over more than one rank)."""
    return d.dp_shard in ("grads", "full") and d.dp_shards > 1


def fsdp_exposed(
    d: Dims, colls: list[Collective], rates: Rates, block: dict[str, float], head_backward: float
) -> dict[str, tuple[float, float]]:
    """purpose -> (seconds, hidden seconds) of FSDP2's DP collectives as it schedules them (torch's
    fully_shard, one unit per block and the root; docs/time-model.md): each unit's all-gather on its
    own stream, the next block's issued while this block computes (forward: implicit prefetch, as the
    host runs ahead; backward: backward_prefetch), each block's reduce-scatter (and HSDP's all-reduce
    over the replicas after it) running beside the next block's backward. Exposed: the root's
    gathers, the first block's forward gather, the last block's backward gather beyond the head's
    backward, the last reduce-scatters (the first block's, the root's), and in between, per block,
    what its collectives take beyond the block's compute. Where the collectives have no cores of
    their own (`Rates.overlap`), nothing is hidden. The collectives' totals are `colls`' (the memory
    model's counted rows), shared among the units by their shard sizes; contention for the GPU's SMs
    and memory between the collectives and the compute is not modelled."""
    shards = unit_shards(d, d.dp_shards)
    whole = sum(shards.values())
    share = {u: n / whole for u, n in shards.items()}
    blocks = [u for u in shards if u != ROOT]
    gathers = 2 if d.dp_shard == "full" else 1

    def per_unit(purpose: str, ops: tuple[str, ...], times: int) -> dict[str, float]:
        """Seconds of one of a unit's `ops` collectives of `purpose` (of `times` a step)."""
        out = dict.fromkeys(shards, 0.0)
        for c in colls:
            if c.purpose == purpose and c.op in ops:
                calls = c.count / (times * len(shards))  # a unit's share of the calls, of the bytes
                for u in shards:
                    out[u] += rates.collective_s(c.op, calls, c.bytes / times * share[u])
        return out

    gather = per_unit("dp_params", ("all_gather",), gathers)
    reduce = per_unit("dp_grads", ("reduce_scatter", "all_reduce"), 1)
    seconds = lambda p: sum(rates.collective_s(c.op, c.count, c.bytes) for c in colls if c.purpose == p)  # noqa: E731
    total = {p: seconds(p) for p in FSDP_PURPOSES}
    if not rates.overlap or not blocks:
        return {p: (s, 0.0) for p, s in total.items()}
    f, b = block[O.FORWARD], block[O.BACKWARD]
    exposed_ag = gather[ROOT] * gathers + gather[blocks[0]]  # forward: the root's, the first block's
    exposed_ag += sum(max(0.0, gather[u] - f) for u in blocks[1:])
    exposed_rs = reduce[blocks[0]] + reduce[ROOT]  # backward's last
    if gathers == 2:  # backward: the last block's gather behind the head's backward
        exposed_ag += max(0.0, gather[blocks[-1]] - head_backward)
    # then each block's backward hides a reduce-scatter (the block after it's) and, with full, a
    # gather (the block before it's); with blocks of one size, as here, these pairs are those windows
    for later, earlier in itertools.pairwise(blocks):
        rs, ag = reduce[later], gather[earlier] if gathers == 2 else 0.0
        over = max(0.0, rs + ag - b)
        if over:
            exposed_rs += over * rs / (rs + ag)
            exposed_ag += over * ag / (rs + ag)
    exposed = {"dp_params": exposed_ag, "dp_grads": exposed_rs}
    return {p: (total[p], max(0.0, total[p] - exposed[p])) for p in FSDP_PURPOSES}


def zero1_buckets(d: Dims) -> bool:
    """Whether ZeRO-1 shards the step's optimizer over more than one rank (its buckets overlapped)."""
    return d.dp_shard == "optimizer" and d.dp_shards > 1


def zero1_exposed(
    d: Dims, colls: list[Collective], rates: Rates, forward_s: float, backward_s: float
) -> dict[str, tuple[float, float]]:
    """purpose -> (seconds, hidden seconds) of ZeRO-1's bucketed collectives as tpbench.parallel.zero
    (Megatron's distributed optimizer) runs them: each bucket's reduce-scatter launched in backward
    once its gradients are in, running beside the backward that follows (`backward_s`: the backward's
    and recompute's compute); the bucket of the model's first parameters (the embedding's), made last,
    and the late bucket (after the TP gradient sums) exposed. After the step each bucket's all-gather
    is launched in the forward's order and waited by the first forward use of its parameters: the
    first bucket's exposed, the others beside the forward (`forward_s`). Exposed too: what the others
    take beyond the compute they hide behind. The collectives' totals are `colls`' (the memory model's
    counted rows), shared among the buckets by their sizes; where the collectives have no cores of
    their own (`Rates.overlap`) nothing is hidden."""
    buckets = zero_buckets(d, d.dp_shards)
    whole = sum(n for n, _ in buckets)

    def times(purpose: str) -> list[float]:
        out = [0.0] * len(buckets)
        for c in colls:
            if c.purpose == purpose:
                for i, (n, _) in enumerate(buckets):
                    out[i] += rates.collective_s(c.op, c.count / len(buckets), c.bytes * n / whole)
        return out

    reduce, gather = times("dp_grads"), times("dp_params")
    total = {"dp_params": sum(gather), "dp_grads": sum(reduce)}
    if not rates.overlap:
        return {p: (s, 0.0) for p, s in total.items()}
    regular = [i for i, (_, late) in enumerate(buckets) if not late]
    late = [i for i, (_, is_late) in enumerate(buckets) if is_late]
    last = regular[-1:]  # the bottom of the model: its gradients are backward's last
    behind = sum(reduce[i] for i in regular[:-1])
    exposed_rs = sum(reduce[i] for i in late + last) + max(0.0, behind - backward_s)
    first = late[0] if late and "model.embed_tokens" in late_params(d) else (last or late)[0]
    exposed_ag = gather[first] + max(0.0, total["dp_params"] - gather[first] - forward_s)
    exposed = {"dp_params": exposed_ag, "dp_grads": exposed_rs}
    return {p: (total[p], max(0.0, total[p] - exposed[p])) for p in total}


def predict_ops(
    d: Dims,
    rows: list[CommRow],
    rates: Rates,
    impl: O.Implementation = O.TPBENCH,
    layer_only: bool = False,
) -> TimePrediction:
    """The step's time on one rank under `d` at `rates`; `layer_only`: one block's forward and
    backward (no embedding, head, loss, optimizer, gradient sums), as Korthikanti et al. time it."""
    step = O.step_ops(d, impl)
    colls = step_collectives(d, rows)
    if layer_only:
        step = [op for op in step if op.layer and op.phase != O.STEP]
        step = [op.times(1 / d.L) for op in step]
        colls = layer_collectives(d)
    calls = sum(c.count for c in colls)
    by_kind: dict[str, float] = defaultdict(float)
    by_phase: dict[str, float] = defaultdict(float)
    by_name: dict[tuple[str, str], float] = defaultdict(float)
    compute = optimizer = head_backward = 0.0
    layer_s: dict[str, float] = {O.FORWARD: 0.0, O.BACKWARD: 0.0}
    dispatches = {"step": 0.0, "optimizer": 0.0}  # the host's issue work: ops, then collectives
    for op in step:
        dispatches["optimizer" if op.phase == O.STEP else "step"] += op.kernels
        roof, fixed = op_time(op, rates)
        by_kind[op.kind] += roof
        by_kind["per-op cost"] += fixed
        seconds = roof + fixed
        by_name[(op.phase, op.name)] += seconds
        if op.phase == O.STEP:
            optimizer += seconds
            by_phase["optimizer"] += seconds
        else:
            compute += seconds
            by_phase[O.FORWARD if op.phase == O.FORWARD else O.BACKWARD] += seconds
            if op.layer:  # the blocks' own: what FSDP2 hides a unit's collectives behind
                layer_s[O.FORWARD if op.phase == O.FORWARD else O.BACKWARD] += seconds
            elif op.phase == O.BACKWARD and op.name != "dp copies":  # the head's, loss's, embedding's
                head_backward += seconds
    exposed: dict[str, float] = defaultdict(float)
    total = 0.0
    backward_compute = sum(s for (phase, _), s in by_name.items() if phase == O.BACKWARD)
    per_layer = 1 if layer_only else d.L
    if fsdp_units(d) and not layer_only:  # FSDP2's gathers and reduce-scatters, as it schedules them
        sharded = [c for c in colls if c.purpose in FSDP_PURPOSES]
        colls = [c for c in colls if c.purpose not in FSDP_PURPOSES]
        block = {phase: seconds / d.L for phase, seconds in layer_s.items()}
        for purpose, (seconds, hidden) in fsdp_exposed(d, sharded, rates, block, head_backward).items():
            total += seconds
            exposed[purpose] += seconds - hidden
            by_phase["grads"] += seconds - hidden
    if zero1_buckets(d) and not layer_only:  # ZeRO-1's buckets, beside backward and the next forward
        sharded = [c for c in colls if c.purpose in FSDP_PURPOSES]
        colls = [c for c in colls if c.purpose not in FSDP_PURPOSES]
        forward_s = sum(s for (phase, _), s in by_name.items() if phase == O.FORWARD)
        backward_s = sum(s for (phase, _), s in by_name.items() if phase in (O.BACKWARD, O.RECOMPUTE))
        for purpose, (seconds, hidden) in zero1_exposed(d, sharded, rates, forward_s, backward_s).items():
            total += seconds
            exposed[purpose] += seconds - hidden
            by_phase[O.FORWARD if purpose == "dp_params" else "grads"] += seconds - hidden
    for c in colls:
        seconds = rates.collective_s(c.op, c.count, c.bytes)
        total += seconds
        hidden = 0.0
        if rates.overlap and c.hidden_behind == ("backward",):  # buckets behind backward, the last not
            hidden = min(seconds - seconds / max(c.count, 1), backward_compute)
        elif rates.overlap and c.hidden_behind and d.overlap:  # each of `count` behind its ops' backward
            work = sum(by_name[(O.BACKWARD, n)] for n in c.hidden_behind) / per_layer
            if c.purpose == "activation":  # an entry's: the column layers' weight gradients, half
                work /= 2  # of their backward
            one = seconds / c.count
            hidden = c.count * min(one, work)
        exposed[c.purpose] += seconds - hidden
        by_phase[c.phase if c.phase in (O.FORWARD, "grads") else O.BACKWARD] += seconds - hidden
    by_kind["collectives"] = sum(exposed.values())
    out = TimePrediction(compute, optimizer, dict(exposed), total, dict(by_kind), dict(by_phase))
    if rates.host_op_s:  # a GPU's host issues every op and collective the device then runs
        out.host_s = rates.host_op_s * (dispatches["step"] + dispatches["optimizer"] + calls)
        out.host_optimizer_s = rates.host_op_s * dispatches["optimizer"]
    return out
