"""What `tpbench fit` searches and answers with: one layout's row, the assumptions every row is made
under, and the whole search (tpbench.sizing.fit says how the rows are made and ranked)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tpbench.config import RunConfig
from tpbench.labels import LEVEL_NAMES
from tpbench.predict.hardware import GPU, RUNTIME_RESERVE_BYTES

MiB, GiB = 2**20, 2**30
# NCCL's buffers of one communicator: NCCL_BUFFSIZE (4 MiB, NCCL's default) per channel for each of
# the ring's two peers, with 16 channels assumed; LL/LL128 and NVLS buffers are left out (--nccl-mib)
NCCL_BUFFSIZE, NCCL_CHANNELS = 4 * MiB, 16
NCCL_BYTES_PER_COMMUNICATOR = 2 * NCCL_CHANNELS * NCCL_BUFFSIZE
CUDA_CONTEXT_BYTES = RUNTIME_RESERVE_BYTES
MARGIN = 0.05  # of the usable memory: a row with less headroom is "tight", not "fits"
RECOMPUTE = ("none", "selective", "op", "full")  # by what a block keeps, most first
LEVELS = ("none", "optimizer", "grads", "full")


class FitError(ValueError):
    """One line naming the bad input (a GPU, a model nothing fits, a seq the model does not allow)."""


@dataclass(frozen=True)
class Overheads:
    """What a rank holds beside PyTorch's allocations: the CUDA context (the runtime reserve, taken off
    the reported memory) and NCCL's buffers per communicator (added to the rank's peak)."""

    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    nccl_bytes_per_communicator: int = NCCL_BYTES_PER_COMMUNICATOR


@dataclass(frozen=True)
class Memory:
    """The GPU's memory as fit counts it: what the driver reports (the table's, or --gpu-memory-gib),
    less the runtime reserve, is usable; a row fits with at least `margin` of it left."""

    reported_bytes: int
    source: str
    reserve_bytes: int = CUDA_CONTEXT_BYTES
    margin: float = MARGIN

    @property
    def usable_bytes(self) -> int:
        return self.reported_bytes - self.reserve_bytes

    @property
    def margin_bytes(self) -> int:
        return int(self.margin * self.usable_bytes)

    @classmethod
    def of(cls, gpu: GPU, overheads: Overheads, reported_bytes: int | None = None, margin: float = MARGIN):
        if reported_bytes is None:
            return cls(gpu.reported_bytes, gpu.reported_source, overheads.cuda_context_bytes, margin)
        return cls(reported_bytes, "given (--gpu-memory-gib)", overheads.cuda_context_bytes, margin)


@dataclass
class Row:
    tp: int
    sp: bool
    vp: bool
    recompute: str
    micro_batch: int
    dp: int = 1
    dp_shard: str = "none"
    dp_replicate: int = 1
    accumulation: int = 1  # micro-steps per optimizer step (global batch / (DP x micro-batch))
    peak_bytes: int = 0  # per rank: predicted max reserved + NCCL buffers (the CUDA context is the reserve)
    live_bytes: int = 0  # theory's live-tensor peak
    moment: str = ""  # where that peak is
    allocated_bytes: int = 0  # live + cuBLAS workspaces: max_memory_allocated
    reserved_bytes: int = 0  # allocated + FSDP2's stream pools: max_memory_reserved (theory.reserved)
    overhead_bytes: int = 0  # NCCL buffers
    headroom_bytes: int = 0  # usable memory less the peak: what fit decides by
    margin_bytes: int = 0
    comm_bytes_per_step: int = 0  # per rank, one micro-step's
    step_s: float = 0.0  # the whole optimizer step: every micro-step, the DP sync, the optimizer
    host_bound: bool = False  # the host's issue time of the step exceeds the device's (steptime)
    tokens_per_step: int = 0  # of the whole job (global batch x seq)
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    recompute_flops_per_step: float = 0.0
    model_flops_per_step: float = 0.0
    capped: bool = False  # the largest micro-batch searched fits: more may
    reason: str = ""  # why the layout cannot run at all; "" when it can
    measured: dict[str, float] = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        return not self.reason and self.headroom_bytes >= 0

    @property
    def fits(self) -> bool:
        return not self.reason and self.headroom_bytes >= self.margin_bytes

    @property
    def tight(self) -> bool:
        return self.runs and not self.fits

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def comm_bytes_per_token(self) -> float:
        tokens = self.tokens_per_step / (self.dp * self.accumulation) if self.tokens_per_step else 0
        return self.comm_bytes_per_step / tokens if tokens else 0.0

    def layout(self) -> str:
        modes = "".join(f" {m}" for m, on in (("SP", self.sp), ("VP", self.vp)) if on)
        dp = f"DP {self.dp}" if self.dp_shard == "none" else f"{LEVEL_NAMES[self.dp_shard]} {self.dp}"
        hsdp = f" ({self.dp_replicate} replicas)" if self.dp_replicate > 1 else ""
        return f"T {self.tp}{modes} x {dp}{hsdp}"

    def label(self) -> str:
        return f"{self.layout()}, recompute {self.recompute}, micro-batch {self.micro_batch}"

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out |= {"fits": self.fits, "tight": self.tight, "gpus": self.gpus, "layout": self.layout()}
        return out | {"comm_bytes_per_token": self.comm_bytes_per_token}


@dataclass
class Fit:
    base: RunConfig
    gpu: GPU
    nodes: int
    gpus_per_node: int
    global_batch: int | None
    overheads: Overheads
    memory: Memory
    rows: list[Row]
    rates: dict = field(default_factory=dict)

    @property
    def fitting(self) -> list[Row]:
        """Ranked: predicted tokens/s per GPU, then headroom."""
        return sorted(
            (r for r in self.rows if r.fits), key=lambda r: (-r.tokens_per_s_per_gpu, -r.headroom_bytes)
        )

    @property
    def tight(self) -> list[Row]:
        return sorted(
            (r for r in self.rows if r.tight), key=lambda r: (-r.tokens_per_s_per_gpu, -r.headroom_bytes)
        )

    @property
    def not_fitting(self) -> list[Row]:
        return sorted((r for r in self.rows if not r.runs), key=lambda r: (bool(r.reason), r.peak_bytes))

    def config(self, row: Row) -> RunConfig:
        return configure(self.base, row)

    def assumptions(self) -> dict:
        t = self.base.train
        return {
            "precision": t.precision,
            "dtype": t.dtype,
            "fused_optimizer": t.fused_optimizer,
            "reported_bytes": self.memory.reported_bytes,
            "reported_source": self.memory.source,
            "reserve_bytes": self.memory.reserve_bytes,
            "usable_bytes": self.memory.usable_bytes,
            "margin": self.memory.margin,
            "margin_bytes": self.memory.margin_bytes,
            "overheads": dataclasses.asdict(self.overheads),
            "rates": self.rates,
            "accumulation": ACCUMULATION,
        }

    def as_dict(self) -> dict:
        return {
            "model": self.base.model.name,
            "seq": self.base.train.seq_len,
            "global_batch": self.global_batch,
            "gpu": dataclasses.asdict(self.gpu),
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "assumptions": self.assumptions(),
            "fits": [r.as_dict() for r in self.fitting],
            "tight": [r.as_dict() for r in self.tight],
            "does_not_fit": [r.as_dict() for r in self.not_fitting],
        }


ACCUMULATION = (
    "N micro-steps, then one DP gradient sync and the optimizer (DDP's all-reduce, ZeRO-1's "
    "reduce-scatter and all-gather, once per step); FSDP's levels (grads, full) gather and "
    "reduce-scatter every micro-step (HSDP all-reduces too), torchtitan's choice, so their gradients "
    "stay sharded: as train.accumulation runs them. Memory: the step's peak, its last micro-step's "
    "beside what the earlier ones leave (every gradient: autograd's own, DDP's beside its buckets, "
    "ZeRO-1's grad buffer, FSDP's shards)"
)


def configure(base: RunConfig, row: Row) -> RunConfig:
    """The run config of one row's micro-step: the base config with the row's layout, recompute and
    micro-batch per DP rank (the row's accumulation is composed from it: search.step_time)."""
    par = dataclasses.replace(
        base.parallel,
        tp=row.tp,
        sp=row.sp,
        vp=row.vp,
        dp=row.dp,
        dp_shard=row.dp_shard,
        dp_replicate=row.dp_replicate,
    )
    train = dataclasses.replace(
        base.train, recompute=row.recompute, micro_batch=row.micro_batch, batch="fixed_per_rank"
    )
    return dataclasses.replace(base, parallel=par, train=train)
