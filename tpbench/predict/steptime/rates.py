"""The rates a step's ops and collectives run at (`Rates`): on a CPU probed on this machine and cached
(tpbench.predict.rate_probe), on a GPU the hardware table's data-sheet peaks times the achievable
fractions below, each with its source and each settable (`gpu_rates(..., **fractions)`).

A GEMM's rate depends on its shape: `gemm_rate` takes the class of its smallest dimension (a skinny
GEMM, one side <= SMALL_DIM, runs well below a square one on a CPU). A collective costs
alpha + ring bytes x beta for its kind and group size: the ring bytes are what
tpbench.parallel.instrumentation counts, so on gloo, whose reduce-scatter is an all-reduce, the
probe measures a reduce-scatter's beta per counted byte at about twice the ring's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpbench.predict.hardware import GPU

SMALL_DIM = 128  # a GEMM with a dimension this small or smaller is of the "small" class

# Achievable fractions of the data-sheet peaks (tpbench.predict.hardware), per GPU family:
# - gemm: Stas Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS comparison table"
#   (compute/accelerator/README.md; bf16 matmul, best shape found by mamf-finder.py): A100 SXM
#   267.9 of 312 TFLOP/s (85.9%, CUDA 12.1), H100 SXM 792.1 of 989 (80.1%), MI300X 781.9 of 1300 (60.1%).
# - nccl: all-reduce bus bandwidth of nccl-tests over 8 GPUs, over the data sheet's NVLink figure
#   (bidirectional): A100-SXM4-80GB ~200 GB/s of 600 (NVIDIA/nccl-tests#149; 208 GB/s in #178);
#   8 x H200 on NVLink 4 (the H100's) 475 GB/s of 900 (NVIDIA/nccl-tests#272).
# - hbm: assumed, not measured by a cited source: 0.85 of the data sheet's bandwidth for a streaming
#   elementwise kernel.
# - attention: a flash kernel's FLOPs; the manual attention's softmax, mask and dropout are
#   elementwise (hbm), its two products GEMMs. FlashAttention-2 reaches "up to 225 TFLOPs/s" forward
#   and backward on an A100, 72% of peak (Dao 2023, "FlashAttention-2", abstract): an upper figure.
#   On Hopper (H100, H200) the same kernel, which torch's SDPA runs (its flash backend is
#   FlashAttention-2), reaches "only 35% utilization on the H100 GPU" (Shah et al. 2024,
#   "FlashAttention-3", arXiv 2407.08608, abstract): FlashAttention-3's 75% needs Hopper's own
#   instructions, which FlashAttention-2 does not use.
# - launch_s: one kernel's fixed cost; on a GPU it overlaps with the kernels before it (the host
#   runs ahead), so an op costs max(its roofline time, its kernels x launch_s). Assumed 5 us.
FRACTIONS: dict[str, dict[str, float]] = {
    "A100": {"gemm": 0.859, "nccl": 200 / 600, "hbm": 0.85},
    "H100": {"gemm": 0.801, "nccl": 475 / 900, "hbm": 0.85, "attention": 0.35},
    "H200": {"gemm": 0.801, "nccl": 475 / 900, "hbm": 0.85, "attention": 0.35},
    "MI300X": {"gemm": 0.601, "nccl": 0.5, "hbm": 0.85},
}
DEFAULT_FRACTIONS = {
    "gemm": 0.7,
    "nccl": 0.5,
    "hbm": 0.85,
    "attention": 0.72,
}  # GPUs with no published figure above
GPU_LAUNCH_S = 5e-6
# The host's time to issue one eager aten op on a GPU node (Python, torch's dispatcher, the CUDA
# launch), for a GPU not at hand: 8 us, `torch.add` of two [512, 512] CUDA tensors issued back to back
# and synchronised once on an A100 node ("cuda_sub", flagos-ai/Torch-FL pull request 27, 2026-07-28).
# A call from Python; autograd's backward ops are issued from C++ and may cost less. On the GPU at
# hand, host_probe.cuda_host_op_s measures it instead (the same probe's shape).
HOST_OP_S = 8e-6
NCCL_ALPHA_S = 20e-6  # a ring collective's latency within an NVLink node (assumed)
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Rates:
    """What a step's time is made of: FLOP/s per GEMM class and of attention, bytes/s of memory, the
    fixed cost per kernel, and per collective kind alpha (s) and beta (s per ring byte)."""

    gemm: dict[str, float]  # "large" | "small" -> FLOP/s
    attention: float  # FLOP/s of the flash attention kernel
    bandwidth: float  # bytes/s of an elementwise kernel reading and writing memory
    op_s: float  # fixed cost of one kernel (launch; on a CPU Python, dispatch and autograd)
    alpha: dict[str, float]  # collective kind -> s
    beta: dict[str, float]  # collective kind -> s per ring byte
    gpu: bool = False  # a GPU: the fixed cost overlaps with the kernels, collectives with compute
    source: str = ""
    overlap: bool = True  # a collective can run beside compute (False: it takes the compute's cores)
    peak: float = 0.0  # the MFU's denominator: FLOP/s of one device
    notes: dict[str, str] = field(default_factory=dict)
    # launch.bf16_gemm=fp32_accumulate (tpbench.models.gemm): each bf16 GEMM an fp32 one of its
    # inputs widened and its output rounded, three casts that move 3 x the GEMM's bf16 bytes (read 2,
    # write 4 per input element; read 4, write 2 per output element); 0: native GEMMs
    widen: float = 0.0
    # bytes/s of passes over operands the cache holds (an op's `memory_bytes`); 0: `bandwidth`
    cache_bandwidth: float = 0.0
    # a GPU's host: seconds to issue one dispatched op or collective (HOST_OP_S, or probed); 0 on a
    # CPU, whose per-op cost (`op_s`) is already on the compute's thread
    host_op_s: float = 0.0

    @property
    def cached(self) -> float:
        return self.cache_bandwidth or self.bandwidth

    def gemm_rate(self, mnk: tuple[int, int, int]) -> float:
        return self.gemm["small" if min(mnk) <= SMALL_DIM else "large"]

    def collective_s(self, kind: str, count: int, ring_bytes: float) -> float:
        return count * self.alpha[kind] + ring_bytes * self.beta[kind]


def gpu_rates(
    gpu: GPU, dtype: str, tf32: bool = False, host_op_s: float = HOST_OP_S, **fractions: float
) -> Rates:
    """A GPU's rates from its data sheet and the achievable fractions (FRACTIONS; any set here); the
    host's issue cost per op, HOST_OP_S unless given (probed on the GPU at hand)."""
    f = {**DEFAULT_FRACTIONS, **FRACTIONS.get(gpu.family, {}), **fractions}
    peak = gpu.peak_flops(dtype, tf32) or gpu.fp32
    gemm = peak * f["gemm"]
    bus = gpu.interconnect_bytes_per_s * f["nccl"]
    return Rates(
        gemm={"large": gemm, "small": gemm},
        attention=peak * f["attention"],
        bandwidth=gpu.hbm_bytes_per_s * f["hbm"],
        op_s=GPU_LAUNCH_S,
        alpha=dict.fromkeys(KINDS, NCCL_ALPHA_S),
        beta=dict.fromkeys(KINDS, 1 / bus),
        gpu=True,
        source=f"{gpu.name} data sheet x fractions {f}, host {host_op_s * 1e6:.3g} us an op",
        peak=peak,
        host_op_s=host_op_s,
    )
