"""The GPUs tpbench knows, in one table: memory, peak FLOP/s, memory and interconnect bandwidth, and
what the caching-allocator model needs (tpbench.predict.allocator), for the allocator, MFU and `tpbench fit`.

Every figure is the vendor's data sheet's, cited beside its row. Peak FLOP/s are dense (the sheets'
headline tensor figures are with 2:4 sparsity: half of them), per GPU, for matmuls in bfloat16 and
float16 (tensor cores), TF32 (fp32 matmuls on the tensor cores) and plain fp32 (no tensor cores).
Memory is the sheet's capacity read as GiB (HBM and GDDR come in binary sizes). What a program can
have of it is less: `reported_bytes` is the total the driver reports (nvidia-smi's memory.total) where
a published nvidia-smi listing gives it, else the sheet's capacity; `tpbench fit` takes a runtime
reserve (the CUDA context, RUNTIME_RESERVE_BYTES) off that and calls the rest usable; both are settable
there (--gpu-memory-gib, --cuda-context-mib). Interconnect: NVLink per GPU (both directions,
as the sheets state it), or the PCIe link where the GPU has no NVLink.

A GPU is named by its row's name or an alias (any case). Its `family` is the word a device name carries
("NVIDIA H100 80GB HBM3" is an H100): the allocator model's name for it, since the allocator's rules
depend only on the CUDA architecture (`cuda_major`: cuBLAS's default workspace grows on Hopper).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GiB, GB, TB, MiB = 2**30, 10**9, 10**12, 2**20
# The CUDA context of a PyTorch process, kernels loaded lazily (CUDA_MODULE_LOADING=LAZY, PyTorch's
# default): an assumed figure, not a measured one; nvidia-smi's use of a process that has only
# initialised CUDA gives your own (`tpbench fit --cuda-context-mib`)
RUNTIME_RESERVE_BYTES = 512 * MiB
# memory.total as nvidia-smi reports it, MiB, per device: the listing of nvidia-smi's totals on Modal's
# GPUs in modal-labs/modal-client pull request 2797 (2025-01-23): H100 81559MiB, A100 80GB 81920MiB,
# A100 40GB 40960MiB, A10 23028MiB, L40S 46068MiB, L4 23034MiB; the H100's 81559MiB also in the
# nvidia-smi listing of an "NVIDIA H100 80GB HBM3" in huggingface/text-embeddings-inference issue 350.
# Rows without one keep the sheet's capacity as what is reported (said in `tpbench fit`'s assumptions)
DRIVER_MIB = {
    "H100-SXM": 81559,
    "A100-80GB": 81920,
    "A100-40GB": 40960,
    "A10": 23028,
    "L40S": 46068,
    "L4": 23034,
}


@dataclass(frozen=True)
class GPU:
    name: str
    family: str
    memory_bytes: int
    bf16: float | None  # dense peak FLOP/s; None: no such tensor-core path
    fp16: float
    tf32: float | None
    fp32: float
    hbm_bytes_per_s: float
    interconnect: str
    interconnect_bytes_per_s: float
    cuda_major: int  # the compute capability's major: what cuBLAS's default workspace depends on
    device_name: str = ""  # a regex for torch.cuda.get_device_name's variants of this row
    aliases: tuple[str, ...] = ()
    note: str = ""

    @property
    def reported_bytes(self) -> int:
        """The memory the driver reports (nvidia-smi's memory.total); the sheet's where none is cited."""
        mib = DRIVER_MIB.get(self.name)
        return self.memory_bytes if mib is None else mib * MiB

    @property
    def reported_source(self) -> str:
        return (
            "nvidia-smi's memory.total"
            if self.name in DRIVER_MIB
            else "the data sheet (no nvidia-smi figure cited)"
        )

    def peak_flops(self, dtype: str, tf32: bool = False) -> float | None:
        """Dense peak FLOP/s of matmuls in `dtype` (train.dtype); fp32 on the tensor cores with tf32."""
        if dtype == "bfloat16":
            return self.bf16
        if dtype == "float16":
            return self.fp16
        return self.tf32 if tf32 else self.fp32


def _gpu(name, family, memory_gb, tflops, hbm_tb_s, link, link_gb_s, major, bf16=True, **kw) -> GPU:
    """A row in the data sheets' units: GB (read as GiB), dense TFLOP/s (16-bit, TF32, FP32), TB/s, GB/s."""
    half, tf32, fp32 = (None if f is None else float(round(f * 1e12)) for f in tflops)  # 66.9e12, exactly
    bf = half if bf16 else None
    return GPU(
        name,
        family,
        memory_gb * GiB,
        bf,
        half,
        tf32,
        fp32,
        round(hbm_tb_s * TB),
        link,
        link_gb_s * GB,
        major,
        **kw,
    )


# fmt: off
# Matched against device names in this order: each family's variants before its catch-all row (the last
# of the family, which also takes a device name that names only the family).
GPUS: tuple[GPU, ...] = (
    # NVIDIA A100 Tensor Core GPU data sheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): BF16/FP16
    # 312 TF, TF32 156 TF, FP32 19.5 TF; 40GB HBM2 1,555 GB/s; 80GB HBM2e 1,935 GB/s (PCIe), 2,039 GB/s
    # (SXM); NVLink 600 GB/s (SXM; PCIe: NVLink Bridge for 2 GPUs, 600 GB/s)
    _gpu("A100-PCIe-40GB", "A100", 40, (312, 156, 19.5), 1.555, "NVLink bridge", 600, 8,
         device_name=r"A100-PCIE-40GB|A100 40GB PCIe"),
    _gpu("A100-PCIe-80GB", "A100", 80, (312, 156, 19.5), 1.935, "NVLink bridge", 600, 8,
         device_name=r"A100 80GB PCIe|A100-PCIE-80GB"),
    _gpu("A100-80GB", "A100", 80, (312, 156, 19.5), 2.039, "NVLink 3", 600, 8,
         device_name=r"A100-SXM4?-80GB", aliases=("A100-SXM-80GB", "A100-SXM4-80GB")),
    _gpu("A100-40GB", "A100", 40, (312, 156, 19.5), 1.555, "NVLink 3", 600, 8,
         device_name=r"A100-SXM4?-40GB", aliases=("A100-SXM-40GB", "A100-SXM4-40GB")),
    # NVIDIA H100 Tensor Core GPU data sheet (H100 SXM / H100 NVL; figures with sparsity halved): SXM 80GB
    # HBM3 3.35 TB/s, BF16 989.4 TF, TF32 494.7, FP32 66.9, NVLink 900 GB/s; NVL 94GB 3.9 TB/s, BF16 835.5,
    # TF32 417.5, FP32 60, NVLink bridge 600 GB/s. H100 PCIe data sheet: 80GB HBM2e 2.0 TB/s, BF16 756.5,
    # TF32 378, FP32 51.2, NVLink bridge 600 GB/s
    _gpu("H100-NVL", "H100", 94, (835.5, 417.5, 60), 3.9, "NVLink bridge", 600, 9, device_name=r"H100 NVL"),
    _gpu("H100-PCIe", "H100", 80, (756.5, 378, 51.2), 2.0, "NVLink bridge", 600, 9, device_name=r"H100 PCIe"),
    _gpu("H100-SXM", "H100", 80, (989.4, 494.7, 66.9), 3.35, "NVLink 4", 900, 9,
         device_name=r"H100 80GB HBM3|H100 SXM", aliases=("H100-80GB", "H100-SXM5", "H100")),
    # NVIDIA H200 Tensor Core GPU data sheet: 141GB HBM3e 4.8 TB/s; SXM: BF16 989.4 TF, TF32 494.7, FP32
    # 67 (66.9 as the H100's), NVLink 900 GB/s; NVL: BF16 835.5, TF32 417.5, FP32 60, NVLink bridge 900 GB/s
    _gpu("H200-NVL", "H200", 141, (835.5, 417.5, 60), 4.8, "NVLink bridge", 900, 9, device_name=r"H200 NVL"),
    _gpu("H200", "H200", 141, (989.4, 494.7, 66.9), 4.8, "NVLink 4", 900, 9,
         aliases=("H200-SXM", "H200-141GB")),
    # NVIDIA HGX B200 data sheet (8 GPUs: 1.44 TB of HBM3e, 64 TB/s; BF16 36 PF, TF32 18 PF with sparsity;
    # FP32 600 TF), per GPU: 180 GB (the first DGX B200 sheet said 192 GB), 8 TB/s, BF16 2.25 PF dense,
    # TF32 1.125 PF, FP32 75 TF, NVLink 5 1.8 TB/s
    _gpu("B200", "B200", 180, (2250, 1125, 75), 8.0, "NVLink 5", 1800, 10),
    # NVIDIA L40S data sheet: 48GB GDDR6 864 GB/s, BF16 362.05 TF, TF32 183, FP32 91.6, PCIe Gen4 x16
    # 64 GB/s (no NVLink)
    _gpu("L40S", "L40S", 48, (362.05, 183, 91.6), 0.864, "PCIe Gen4 x16", 64, 8),
    # NVIDIA A10 data sheet: 24GB GDDR6 600 GB/s, BF16 125 TF, TF32 62.5, FP32 31.2, PCIe Gen4 64 GB/s
    _gpu("A10", "A10", 24, (125, 62.5, 31.2), 0.6, "PCIe Gen4 x16", 64, 8),
    # NVIDIA L4 data sheet: 24GB GDDR6 300 GB/s, BF16 121 TF, TF32 60, FP32 30.3, PCIe Gen4 x16 64 GB/s
    _gpu("L4", "L4", 24, (121, 60, 30.3), 0.3, "PCIe Gen4 x16", 64, 8),
    # NVIDIA V100 data sheet (SXM2 32GB): HBM2 900 GB/s, FP16 tensor 125 TF, no BF16 or TF32, FP32 15.7 TF,
    # NVLink 2 300 GB/s
    _gpu("V100", "V100", 32, (125, None, 15.7), 0.9, "NVLink 2", 300, 7, bf16=False,
         aliases=("V100-SXM2-32GB",)),
    # AMD Instinct MI300X data sheet: 192GB HBM3 5.3 TB/s, BF16 1307.4 TF dense, TF32 653.7, FP32 163.4,
    # Infinity Fabric 896 GB/s (7 links x 128 GB/s). ROCm's PyTorch runs the same caching allocator: its
    # rules are assumed to be PyTorch's on ROCm, its BLAS workspace Hopper's (hipBLASLt's is not modelled)
    _gpu("MI300X", "MI300X", 192, (1307.4, 653.7, 163.4), 5.3, "Infinity Fabric", 896, 9,
         note="allocator rules assumed: PyTorch's on ROCm"),
)
# fmt: on

BY_NAME: dict[str, GPU] = {n.upper(): g for g in GPUS for n in (g.name, *g.aliases)}
FAMILIES: dict[str, int] = {g.family: g.cuda_major for g in GPUS}  # the allocator's names


def names() -> tuple[str, ...]:
    """Every name `gpu` accepts: the rows' names and aliases."""
    return tuple(n for g in GPUS for n in (g.name, *g.aliases))


def allocator_names() -> tuple[str, ...]:
    """Every name the allocator model takes (launch.emulate_gpu): the rows' names, aliases and families."""
    return tuple(dict.fromkeys((*names(), *FAMILIES)))


def gpu(name: str) -> GPU | None:
    """The row a name or alias names (any case), or None."""
    return BY_NAME.get(name.upper())


def cuda_major(name: str) -> int:
    """The compute capability's major of a family, row name or alias."""
    row = gpu(name)
    return row.cuda_major if row is not None else FAMILIES[name]


def of_device(device_name: str) -> GPU | None:
    """The row a device name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB") names, or None: a
    variant's own pattern first, else the last row of the family the name carries."""
    for row in GPUS:
        if row.device_name and re.search(row.device_name, device_name, re.IGNORECASE):
            return row
    family = family_of(device_name)
    return None if family is None else [g for g in GPUS if g.family == family][-1]


def family_of(device_name: str) -> str | None:
    """The family a device name carries as a word ("NVIDIA A10" is an A10, "NVIDIA A100 ..." is not)."""
    return next((f for f in FAMILIES if re.search(rf"\b{f}\b", device_name, re.IGNORECASE)), None)
