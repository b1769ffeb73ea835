"""`tpbench fit`: how one model can train on one GPU type, every tensor-parallel layout ranked.

For a model, a sequence length and a GPU of tpbench.predict.hardware with G GPUs per node, every T that
divides G and the model's heads is crossed with SP, VP and recompute (none, selective, full), each at the
largest micro-batch that fits (with global_batch=B: the largest divisor of B, the rest made of B / b
DP replicas). Nothing runs: each row is the analytic model's (tpbench.predict.theory), as `tpbench plan`
prints it, on that GPU:

  per-rank peak  theory's live-tensor peak + 2 cuBLAS workspaces (Prediction.max_memory_allocated_bytes,
                 the allocator's blocks that hold no tensor) + the CUDA context + NCCL's buffers, one
                 set per process group the rank talks in (the world's, TP's, DP's, the KV replicas').
                 The last two are constants stated here, settable, never fitted to anything
  headroom       the GPU's memory less that peak
  bytes moved    theory's collective bytes per rank and step (CommCounter's ring bytes)
  recompute      the FLOPs full recompute adds to a step, over every rank (selective remakes no matmul)

Not counted: the caching allocator's rounding and fragmentation (max_memory_reserved over allocated),
which `--measure` replays from an emulated step of the chosen rows (tpbench.parallel.emulation, fake tensors).
Ranked: fewest GPUs per replica (T) first, then least recompute, then fewest bytes moved per token
(so that micro-batches of different sizes compare), then the larger micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rich.table import Table

from tpbench.config import ConfigError, RunConfig
from tpbench.predict import hardware, theory
from tpbench.predict.hardware import GPU
from tpbench.run import compose

MiB, GiB = 2**20, 2**30
# The CUDA context of a PyTorch process, with its kernels loaded lazily (CUDA_MODULE_LOADING=LAZY,
# PyTorch's default): an assumed figure, not a measured one; nvidia-smi's use of a process that has
# only initialised CUDA gives your own (--cuda-context-mib)
CUDA_CONTEXT_BYTES = 512 * MiB
# NCCL's buffers of one communicator: NCCL_BUFFSIZE (4 MiB, NCCL's default) per channel for each of
# the ring's two peers, with 16 channels assumed; LL/LL128 and NVLS buffers are left out (--nccl-mib)
NCCL_BUFFSIZE, NCCL_CHANNELS = 4 * MiB, 16
NCCL_BYTES_PER_COMMUNICATOR = 2 * NCCL_CHANNELS * NCCL_BUFFSIZE
RECOMPUTE = ("none", "selective", "full")
MAX_MICRO_BATCH = 256
# what fit searches itself: an override of one of these keeps the search to its value
SEARCHED = ("parallel.tp", "parallel.sp", "parallel.vp", "train.recompute", "train.micro_batch")


class FitError(ValueError):
    """One line naming the bad input (a GPU, a model no T fits, a seq the model does not allow)."""


@dataclass(frozen=True)
class Overheads:
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    nccl_bytes_per_communicator: int = NCCL_BYTES_PER_COMMUNICATOR


@dataclass
class Row:
    tp: int
    sp: bool
    vp: bool
    recompute: str
    micro_batch: int
    dp: int = 1
    peak_bytes: int = 0  # per rank on the GPU: allocated + CUDA context + NCCL
    live_bytes: int = 0  # theory's live-tensor peak
    moment: str = ""  # where that peak is
    allocated_bytes: int = 0  # live + cuBLAS workspaces: max_memory_allocated
    overhead_bytes: int = 0  # CUDA context + NCCL buffers
    headroom_bytes: int = 0
    comm_bytes_per_step: int = 0
    tokens_per_step: int = 0  # of one replica
    recompute_flops_per_step: float = 0.0
    model_flops_per_step: float = 0.0
    capped: bool = False  # the largest micro-batch searched fits: more may
    reason: str = ""  # why the layout cannot run at all; "" when it can
    measured: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.reason and self.headroom_bytes >= 0

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def comm_bytes_per_token(self) -> float:
        return self.comm_bytes_per_step / self.tokens_per_step if self.tokens_per_step else 0.0

    def label(self) -> str:
        modes = "".join(f" {m}" for m, on in (("sp", self.sp), ("vp", self.vp)) if on)
        return f"T {self.tp}{modes} recompute {self.recompute}, micro-batch {self.micro_batch}"

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out |= {"fits": self.fits, "gpus": self.gpus, "comm_bytes_per_token": self.comm_bytes_per_token}
        return out


@dataclass
class Fit:
    base: RunConfig
    gpu: GPU
    gpus_per_node: int
    global_batch: int | None
    overheads: Overheads
    rows: list[Row]

    @property
    def fitting(self) -> list[Row]:
        rank = {r: i for i, r in enumerate(RECOMPUTE)}
        key = lambda r: (r.tp, rank[r.recompute], r.comm_bytes_per_token, -r.micro_batch)  # noqa: E731
        return sorted((r for r in self.rows if r.fits), key=key)

    @property
    def not_fitting(self) -> list[Row]:
        return sorted(
            (r for r in self.rows if not r.fits), key=lambda r: (bool(r.reason), r.tp, r.peak_bytes)
        )

    def config(self, row: Row) -> RunConfig:
        return configure(self.base, row, self.global_batch)

    def as_dict(self) -> dict:
        m, t = self.base.model, self.base.train
        return {
            "model": m.name,
            "seq": t.seq_len,
            "dtype": t.dtype,
            "precision": t.precision,
            "fused_optimizer": t.fused_optimizer,
            "global_batch": self.global_batch,
            "gpu": dataclasses.asdict(self.gpu),
            "gpus_per_node": self.gpus_per_node,
            "overheads": dataclasses.asdict(self.overheads),
            "fits": [r.as_dict() for r in self.fitting],
            "does_not_fit": [r.as_dict() for r in self.not_fitting],
        }


@dataclass
class Request:
    """What `tpbench fit` was asked: the GPU, how many a node has, the overrides its config is composed
    from (the user's and fit's own), which searched keys the user fixed, and the global batch if any."""

    gpu: GPU
    gpus_per_node: int
    overrides: list[str]
    given: set[str]
    global_batch: int | None


def parse(overrides: list[str]) -> Request:
    """Split fit's own keys (gpu=NAME, gpus_per_node=N) from the config's overrides and add fit's
    defaults: a memory experiment on an emulated GPU of that kind, T 1 to start from, bf16 with fused
    AdamW unless the overrides say otherwise."""
    own, rest, keyed = {}, [], {}
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("gpu", "gpus_per_node"):
            own[key] = value
        else:
            rest.append(o)
            keyed[compose.SHORT_NAMES.get(key.lstrip("+~"), key.lstrip("+~"))] = o
    name = own.get("gpu", "")
    gpu = hardware.gpu(name)
    if gpu is None:
        what = f"gpu={name}" if name else "fit needs gpu=NAME"
        raise FitError(f"{what}: accepted are {', '.join(hardware.names())}")
    per_node = own.get("gpus_per_node", "8")
    if not per_node.isdecimal() or int(per_node) < 1:
        raise FitError(f"gpus_per_node={per_node}: accepted are integers >= 1")
    keys = set(keyed)
    for key in ("kind", "launch.device", "launch.emulate", "launch.emulate_gpu"):
        if key in keys:
            raise FitError(f"{key}: fit sets it itself (a memory experiment on an emulated {gpu.name})")
    if "parallel.dp" in keys:
        raise FitError(
            f"{keyed['parallel.dp']}: fit sets DP itself (global_batch / the micro-batch, else 1); "
            "accepted is global_batch=N"
        )
    given = keys & set(SEARCHED)
    if "mode" in keys:  # a mode fixes the layout's switches; T stays searched unless tp= is given
        mode = keyed["mode"].partition("=")[2]
        if mode == "ddp" or "," in mode:
            raise FitError(f"{keyed['mode']}: fit takes one tensor-parallel mode (T 1 is DDP's row)")
        given |= {"parallel.sp", "parallel.vp"}
    if "train.seq_len" not in keys:
        raise FitError("fit needs seq=LENGTH: the sequence length to train at")
    added = ["kind=memory", "launch.device=cuda", "launch.emulate=fake", f"launch.emulate_gpu={gpu.name}"]
    added += [] if "parallel.tp" in keys else ["parallel.tp=1"]
    added += [] if "train.dtype" in keys else ["train.dtype=bfloat16"]
    # pure unless given, whatever the model's preset trains with (mixed): fit's tables are pure bf16's
    added += [] if "train.precision" in keys else ["train.precision=pure"]
    added += [] if "train.fused_optimizer" in keys else ["train.fused_optimizer=true"]
    global_batch = None
    if "train.global_batch" in keys:
        value = keyed["train.global_batch"]
        text = value.partition("=")[2]
        if not text.isdecimal() or int(text) < 1:
            raise FitError(f"{value}: accepted is one integer >= 1")
        global_batch = int(text)
        added.append("train.batch=fixed_global")
    return Request(gpu, int(per_node), [*rest, *added], given, global_batch)


def configure(base: RunConfig, row: Row, global_batch: int | None) -> RunConfig:
    """The run config of one row: the base config with the row's layout, recompute and batch."""
    par = dataclasses.replace(base.parallel, tp=row.tp, sp=row.sp, vp=row.vp, dp=row.dp)
    train = dataclasses.replace(base.train, recompute=row.recompute, micro_batch=row.micro_batch)
    if global_batch is not None:
        train = dataclasses.replace(train, batch="fixed_global", global_batch=global_batch)
    return dataclasses.replace(base, parallel=par, train=train)


def search(
    base: RunConfig,
    gpu: GPU,
    gpus_per_node: int,
    given: set[str],
    global_batch: int | None = None,
    overheads: Overheads = Overheads(),
    max_micro_batch: int = MAX_MICRO_BATCH,
) -> Fit:
    """Every layout of `base`'s model on `gpu`, each at its largest micro-batch that fits. `given`:
    the keys the user set, among SEARCHED: the search keeps to base's value of those."""
    m, t = base.model, base.train
    if t.seq_len > m.max_position_embeddings:
        raise FitError(
            f"train.seq_len={t.seq_len}: {m.name} allows up to model.max_position_embeddings="
            f"{m.max_position_embeddings} positions"
        )
    p = base.parallel
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
    if global_batch is not None:
        batches = [b for b in range(1, global_batch + 1) if global_batch % b == 0]
    else:
        batches = list(range(1, max_micro_batch + 1))
    if "train.micro_batch" in given:
        if global_batch is not None and global_batch % t.micro_batch:
            raise FitError(f"train.micro_batch={t.micro_batch} does not divide global_batch={global_batch}")
        batches = [t.micro_batch]
    rows = []
    for T in tps:
        for sp, vp in [(False, False)] if T == 1 else [(s, v) for s in (False, True) for v in (False, True)]:
            if ("parallel.sp" in given and sp != p.sp) or ("parallel.vp" in given and vp != p.vp):
                continue
            for recompute in [t.recompute] if "train.recompute" in given else RECOMPUTE:
                row = Row(T, sp, vp, recompute, batches[0])
                rows.append(_largest(base, gpu, row, batches, global_batch, overheads))
    result = Fit(base, gpu, gpus_per_node, global_batch, overheads, rows)
    if not result.fitting:
        runnable = [r for r in result.not_fitting if not r.reason]
        if not runnable:
            raise FitError(f"{m.name}: no layout can run ({result.not_fitting[0].reason})")
        best = min(runnable, key=lambda r: r.peak_bytes)
        raise FitError(
            f"{m.name} at S {t.seq_len} fits no T on {gpu.name} ({gpu.memory_bytes / GiB:.0f} GiB) with "
            f"{gpus_per_node} per node: the least per-rank peak is {best.peak_bytes / GiB:,.1f} GiB "
            f"({best.label()}); accepted are a GPU with more memory, a shorter seq, or another precision"
        )
    return result


def _largest(
    base: RunConfig, gpu: GPU, row: Row, batches: list[int], global_batch: int | None, overheads: Overheads
) -> Row:
    """The row at the largest of `batches` that fits (memory grows with the micro-batch): doubling the
    index from the smallest, then halving the interval; the smallest's row if none fits."""
    try:
        compose.check(configure(base, _with(row, batches[0], global_batch), global_batch))
    except ConfigError as e:
        return dataclasses.replace(row, reason=str(e))
    low = _evaluate(base, gpu, _with(row, batches[0], global_batch), global_batch, overheads)
    if not low.fits:
        return low
    lo, step = 0, 1
    hi = None  # the first index known not to fit
    while hi is None and lo + step < len(batches):
        candidate = _evaluate(
            base, gpu, _with(row, batches[lo + step], global_batch), global_batch, overheads
        )
        if candidate.fits:
            lo, low, step = lo + step, candidate, step * 2
        else:
            hi = lo + step
    hi = len(batches) if hi is None else hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        candidate = _evaluate(base, gpu, _with(row, batches[mid], global_batch), global_batch, overheads)
        lo, low, hi = (mid, candidate, hi) if candidate.fits else (lo, low, mid)
    searched = len(batches) > 1 and global_batch is None  # a given micro-batch is that, not a minimum
    return dataclasses.replace(low, capped=searched and lo == len(batches) - 1)


def _with(row: Row, micro_batch: int, global_batch: int | None) -> Row:
    dp = global_batch // micro_batch if global_batch is not None else 1
    return dataclasses.replace(row, micro_batch=micro_batch, dp=dp)


def _evaluate(base: RunConfig, gpu: GPU, row: Row, global_batch: int | None, overheads: Overheads) -> Row:
    cfg = configure(base, row, global_batch)
    prediction = theory.predict(cfg)
    allocated = prediction.max_memory_allocated_bytes(gpu.name)
    overhead = overheads.cuda_context_bytes + overheads.nccl_bytes_per_communicator * communicators(cfg)
    peak = allocated + overhead
    return dataclasses.replace(
        row,
        peak_bytes=peak,
        live_bytes=prediction.peak_bytes,
        moment=prediction.peak.name,
        allocated_bytes=allocated,
        overhead_bytes=overhead,
        headroom_bytes=gpu.memory_bytes - peak,
        comm_bytes_per_step=prediction.comm_bytes_per_step,
        tokens_per_step=row.micro_batch * cfg.train.seq_len,
        recompute_flops_per_step=theory.recompute_flops_per_step(cfg),
        model_flops_per_step=theory.model_flops_per_step(cfg),
    )


def communicators(cfg: RunConfig) -> int:
    """NCCL communicators of one rank: the world's, its TP group's, its DP group's and its KV-replica
    group's (T > N_kv), each of more than one rank (tpbench.parallel.context makes them)."""
    T, dp, kv = cfg.parallel.tp, cfg.parallel.dp, cfg.model.num_key_value_heads
    return sum((T * dp > 1, T > 1, dp > 1, T > kv))


# --- what it prints -----------------------------------------------------------------------------


def tables(fit: Fit) -> list[Table]:
    """The ranked table of what fits and the table of what does not."""
    m, t, gpu = fit.base.model, fit.base.train, fit.gpu
    o = fit.overheads
    title = (
        f"{m.name} S {t.seq_len} {t.dtype} {t.precision}"
        + (", fused AdamW" if t.fused_optimizer else "")
        + (f", global batch {fit.global_batch}" if fit.global_batch else "")
        + f" on {gpu.name} ({gpu.memory_bytes / GiB:.0f} GiB), {fit.gpus_per_node} per node"
    )
    caption = (
        f"per-rank peak: theory's live tensors + 2 cuBLAS workspaces + CUDA context "
        f"{o.cuda_context_bytes / MiB:.0f} MiB + NCCL {o.nccl_bytes_per_communicator / MiB:.0f} MiB per "
        "communicator; comm: per rank; recompute: FLOPs added to the model's (selective remakes no matmul); "
        "micro-batch n+: the largest searched"
    )
    out = []
    for rows, what in ((fit.fitting, "fits"), (fit.not_fitting, "does not fit")):
        if not rows:
            continue
        table = Table(title=f"{title}: {what}", caption=caption if what == "fits" else None)
        columns = ["#", "layout", "recompute", "micro-batch", *(["GPUs"] if fit.global_batch else [])]
        columns += ["peak GiB", "headroom GiB", "peak at", "comm GiB/step", "comm MiB/token", "recompute"]
        columns += ["measured"] if any(r.measured for r in rows) else []
        for c in columns:
            table.add_column(
                c, justify="left" if c in ("layout", "recompute", "peak at", "measured") else "right"
            )
        for i, r in enumerate(rows, 1):
            layout = f"T {r.tp}" + "".join(f" {m}" for m, on in (("SP", r.sp), ("VP", r.vp)) if on)
            if r.reason:
                table.add_row("", layout, r.recompute, *[""] * (len(columns) - 5), r.reason)
                continue
            extra = r.recompute_flops_per_step
            cells = [
                str(i) if r.fits else "",
                layout,
                r.recompute,
                f"{r.micro_batch}" + ("+" if r.capped else ""),
                *([str(r.gpus)] if fit.global_batch else []),
                f"{r.peak_bytes / GiB:,.2f}",
                f"{r.headroom_bytes / GiB:,.2f}",
                r.moment,
                f"{r.comm_bytes_per_step / GiB:,.2f}",
                f"{r.comm_bytes_per_token / MiB:,.2f}",
                f"+{extra / r.model_flops_per_step:.0%} FLOPs" if extra else "",
            ]
            table.add_row(*cells, *([measured_text(r)] if "measured" in columns else []))
        out.append(table)
    return out


def measure(fit: Fit, top: int) -> None:
    """--measure: the `top` best fitting rows confirmed by emulating their busiest rank on fake tensors
    (tpbench.experiments.memory), the allocator model's reserved memory plus the same overheads
    against the GPU's memory; each row's `measured`."""
    from tpbench.experiments import memory  # the model's step runs only for --measure

    for row in fit.fitting[:top]:
        measured, seconds = memory.measure_busiest(fit.config(row))
        reserved = measured["modelled_max_memory_reserved_bytes"] + row.overhead_bytes
        row.measured = {
            "peak_bytes": measured["peak_bytes"],
            "max_memory_allocated_bytes": measured["modelled_max_memory_allocated_bytes"],
            "max_memory_reserved_bytes": measured["modelled_max_memory_reserved_bytes"],
            "reserved_peak_bytes": reserved,
            "fits": reserved <= fit.gpu.memory_bytes,
            "seconds": seconds,
        }


def measured_text(row: Row) -> str:
    """--measure's figures: the emulated rank's live tensors beside theory's, and the allocator model's
    reserved memory with the same CUDA context and NCCL buffers, against the GPU's memory."""
    m = row.measured
    if not m:
        return ""
    verdict = "fits" if m["fits"] else "DOES NOT FIT"
    return (
        f"live {m['peak_bytes'] / GiB:,.2f} GiB (theory {row.live_bytes / GiB:,.2f}); reserved + context + "
        f"NCCL {m['reserved_peak_bytes'] / GiB:,.2f} GiB: {verdict} ({m['seconds']:.0f} s)"
    )


def _yes(on: bool) -> str:
    return "yes" if on else ""
