"""bf16 GEMMs as a GPU computes them, at fp32 speed on a CPU without bf16 units
(`launch.bf16_gemm=fp32_accumulate`).

A GPU's bf16 GEMM reads bf16 inputs, accumulates in fp32 and rounds the result to bf16 once. A CPU
without AVX-512 BF16 computes the same thing in its native bf16 kernels 40-90x slower than fp32
(docs/results/validation.md). At the tiny model's size the mode costs more than it saves (a Python
dispatch per aten op against GEMMs of microseconds); at the seed's check shape and above it pays.

Under `fp32_accumulate` every bf16 GEMM of aten (mm, addmm, bmm, baddbmm, addbmm; nn.Linear and the
matmul operator reach aten as these) runs as the fp32 GEMM of the same bf16 values, rounded once to
bf16: forward and backward, the sharded model, the head, the dense model, anything run inside
`bf16_gemms`. The result equals the native kernel's on all but a few
elements, one bf16 ulp apart where the two sum in another order (tests/test_validation_gemm.py).

Not covered: scaled_dot_product_attention's fused kernel (model.flash_attn=true) keeps its own bf16
arithmetic; it is a small part of a step at the shapes validated here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODES = ("native", "fp32_accumulate")
_aten = torch.ops.aten
GEMMS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.addbmm.default,
    }
)


class Fp32Accumulate(TorchDispatchMode):
    """Runs each bf16 GEMM of aten as its fp32 GEMM rounded once to bf16. `count` says how many it
    ran so (a check that the mode saw the GEMMs)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in GEMMS or not any(_is_bf16(a) for a in args):
            return func(*args, **kwargs)
        self.count += 1
        wide = [a.float() if _is_bf16(a) else a for a in args]
        with torch.autocast(wide[0].device.type, enabled=False):
            return func(*wide, **kwargs).to(torch.bfloat16)


def _is_bf16(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16


@contextlib.contextmanager
def bf16_gemms(mode: str) -> Iterator[Fp32Accumulate | None]:
    """The GEMM arithmetic of everything run inside, forward and backward (a backward started inside
    runs its GEMMs through it too): `native` (torch's kernels, nothing changed; yields None) or
    `fp32_accumulate` (yields the mode, its `count` the GEMMs it ran)."""
    if mode not in MODES:
        raise ValueError(f"bf16_gemm={mode!r}: accepted are {', '.join(MODES)}")
    if mode == "native":
        yield None
        return
    with Fp32Accumulate() as gemm_mode:
        yield gemm_mode
