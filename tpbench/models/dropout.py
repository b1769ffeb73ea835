"""Dropout keyed by position: each element's keep or drop is a hash of (seed, step, call site, the
element's coordinates in the dense tensor), so a shard draws exactly its slice of the dense mask.

Megatron keeps a CUDA RNG tracker so that the ranks of a TP group draw the same mask where an
activation is replicated (the residual stream under plain TP: the default generator, seeded alike on
every TP rank) and independent masks where it is sharded (attention probabilities, split by heads:
a model-parallel generator seeded per rank); under SP the residual stream is split along the
sequence, so its dropout must differ between the ranks too. Drawing the mask from the global
position gives both properties by construction, and more: the sharded model's masks are the dense
model's, so the sharded model equals the dense one exactly, dropout on (tests/test_dropout.py).

The hash is counter based (Wellons' lowbias32) in plain integer tensor ops, on any device and under
fake tensors, in int32: a product wraps modulo 2^32 (two's complement), which is the hash's own
arithmetic, so the bits are those of the unsigned 32-bit hash. torch has no logical right shift of
int32 (its >> copies the sign bit; uint32 has no shifts on CPU), so `x ^= x >>> 16` xors the high
16-bit half of each element into its low half through an int16 view, in place (little-endian), and
`x ^= x >>> 15` shifts and masks a copy. The drop decision compares the unsigned hash with the
threshold as a signed compare of the hash with its top bit flipped. The coordinates are folded in
one dimension at a time (a small broadcast tensor per dimension), so only the last fold runs over
the whole tensor: an int32 [*shape] and one shifted int32 copy alive at once (`mask_bits` of the
theory: 8 bytes an element), transient; the same masks as the int64 hash this replaced, at about
half its passes' bytes (scripts/dropout_speed.py). Backward keeps the 1-byte mask of dropped
elements, as torch's dropout does.

A `PositionalDropout` knows its dims by name (`seq`, `batch`, `head`, ...); the parallel plan tells
it which are split (tpbench.parallel.rng: `splits[name] = (index, parts)`); the model's
`DropoutKey` says the seed and the step (advanced once per training forward of the whole model, so a
recomputed block, run again in backward, draws the same masks).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32's multipliers; the second, above 2^31, as its negative residue mod 2^32
_C2 = 0x846CA68B - 2**32
_TOP = -(2**31)  # int32's top bit
_LITTLE_ENDIAN = sys.byteorder == "little"  # CPUs tpbench runs on and CUDA devices are

# the call sites of a block, in the order they run (the embedding's is its own, below the blocks)
SITES = ("attention", "attention_output", "mlp_output")
STREAM_DIMS = ("seq", "batch", "hidden")  # [S, B, H]
PROBS_DIMS = ("batch", "head", "query", "key")  # [B, N, S, S]


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of contiguous int32 `x` (the unsigned 32-bit values, two's complement), in place;
    returns x."""
    _xor_high_half(x)
    x.mul_(_C1)  # wraps modulo 2^32
    shifted = x >> 15  # the sign copied into the top 15 bits: masked off, a logical shift
    x ^= shifted.bitwise_and_(0x1FFFF)
    del shifted
    x.mul_(_C2)
    _xor_high_half(x)
    return x


def _xor_high_half(x: torch.Tensor) -> None:
    """x ^= x >>> 16 on int32, in place: each element's high 16 bits into its low 16 (an int16 view,
    no copy)."""
    if _LITTLE_ENDIAN and x.is_contiguous():
        halves = x.view(-1).view(torch.int16).view(-1, 2)  # [low, high] per element
        halves[:, 0].bitwise_xor_(halves[:, 1])
    else:
        x ^= (x >> 16).bitwise_and_(0xFFFF)


def mix32_int(x: int) -> int:
    """lowbias32 of a Python int (the key, hashed once per call on the host)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _C1) & MASK32
    x ^= x >> 15
    x = (x * _C2) & MASK32
    return x ^ (x >> 16)


class DropoutKey:
    """The model's dropout seed and training step, shared by all its dropouts.

    Eager, each dropout hashes its key on the host (`site`). Compiled (train.compile), a Python int
    read inside a block would be a constant of its graph, recompiled at every step: `place` gives the
    key a tensor, [] int32 on the model's device, holding the hash of (seed, step) and rewritten in
    place (no host sync) whenever seed or step change, so that a compiled block takes it as an input
    and hashes its site in the graph (`PositionalDropout.dropped`): the same bits."""

    def __init__(self, seed: int = 0, step: int = 0):
        self._seed, self._step = seed, step
        self.tensor: torch.Tensor | None = None  # place(): the compiled blocks' key

    def __repr__(self) -> str:
        return f"DropoutKey(seed={self._seed}, step={self._step})"

    @property
    def seed(self) -> int:
        return self._seed

    @seed.setter
    def seed(self, seed: int) -> None:
        self._seed = seed
        self._write()

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step = step
        self._write()

    def step_key(self) -> int:
        """A 32-bit key of (seed, step)."""
        return mix32_int(mix32_int(self._seed) ^ self._step)

    def site(self, site: int) -> int:
        """A 32-bit key of (seed, step, site)."""
        return mix32_int(self.step_key() ^ site)

    def place(self, device: torch.device) -> None:
        """Give the key its tensor on `device` (apply_compile, once the model is there)."""
        self.tensor = torch.tensor(signed32(self.step_key()), dtype=torch.int32, device=device)

    def _write(self) -> None:
        if self.tensor is not None:
            self.tensor.fill_(signed32(self.step_key()))


def signed32(x: int) -> int:
    """The int32 holding the 32 bits of `x`."""
    x &= MASK32
    return x - 2**32 if x >= 2**31 else x


def dense_mask_bits(
    key: int | torch.Tensor, shape: tuple[int, ...], splits: tuple[tuple[int, int], ...], device: torch.device
) -> torch.Tensor:
    """int32 [*shape]: the 32-bit hash of each element's global coordinates (two's complement), where
    dim i of this shard is part splits[i][0] of splits[i][1] equal parts of the dense dim. key: the
    site's 32-bit key, a Python int or (compiled) an int32 [] tensor of its bits, left as it is."""
    if isinstance(key, torch.Tensor):
        h = key.to(device).reshape((1,) * len(shape))
    else:
        h = torch.full((1,) * len(shape), signed32(key), dtype=torch.int32, device=device)
    for dim, (size, (index, _parts)) in enumerate(zip(shape, splits, strict=True)):
        view = [1] * len(shape)
        view[dim] = size
        # broadcast: only the last fold is the whole tensor's size, the one before freed first
        h = h ^ torch.arange(index * size, (index + 1) * size, dtype=torch.int32, device=device).view(view)
        mix32(h)
    return h


def dropped_where(bits: torch.Tensor, threshold: int) -> torch.Tensor:
    """bool: where the unsigned hash `bits` (int32, from dense_mask_bits) is at least `threshold`
    (in [0, 2^32]); flips the bits' top bit in place, for a signed compare."""
    if threshold >= 2**32:
        return torch.zeros_like(bits, dtype=torch.bool)
    return bits.bitwise_xor_(_TOP) >= threshold - 2**31


class PositionalDropout(nn.Module):
    """Zero each element with probability p, scale the rest by 1 / (1 - p), in training mode; the
    decision a hash of the element's global position (see the module's docstring).

    Args:
        p: the drop probability, in [0, 1).
        site: a number unique to this call site in the model (layer and which dropout).
        dims: the names of the input's dims, in order (STREAM_DIMS, PROBS_DIMS).
        key: the model's DropoutKey (seed and step), shared by all its dropouts.
    """

    def __init__(self, p: float, site: int, dims: tuple[str, ...], key: DropoutKey):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout={p}: accepted are probabilities in [0, 1)")
        self.p, self.site, self.dims, self.key = p, site, dims, key
        self.splits: dict[str, tuple[int, int]] = {}  # dim name -> (this shard's index, parts)
        self.threshold = round((1.0 - p) * 2**32)  # keep where the hash is below it
        self.site_tensor: torch.Tensor | None = None  # place(): the site as a compiled block's input

    def extra_repr(self) -> str:
        split = ", ".join(f"{name} {i}/{n}" for name, (i, n) in self.splits.items() if n > 1)
        return f"p={self.p}, dims [{', '.join(self.dims)}]" + (f"; split {split}" if split else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return _Drop.apply(x, self.dropped(x.shape, x.device), 1.0 / (1.0 - self.p))

    def dropped(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """bool [*shape]: True where this shard drops, its slice of the dense model's mask."""
        splits = tuple(self.splits.get(name, (0, 1)) for name in self.dims)
        if torch.compiler.is_compiling():  # the key a graph input, not a constant (DropoutKey)
            if self.key.tensor is None or self.site_tensor is None:
                raise RuntimeError("a compiled dropout needs its key placed: tpbench.parallel.compiled")
            key = mix32(self.key.tensor.to(device) ^ self.site_tensor.to(device))  # key.site's bits
        else:
            key = self.key.site(self.site)
        bits = dense_mask_bits(key, tuple(shape), splits, device)
        return dropped_where(bits, self.threshold)

    def place(self, device: torch.device) -> None:
        """Give this dropout's site its tensor on `device` (apply_compile places the key's too)."""
        self.site_tensor = torch.tensor(self.site, dtype=torch.int32, device=device)


class _Drop(torch.autograd.Function):
    """x * scale with the dropped elements zeroed; backward the same of the gradient, keeping only the
    1-byte mask."""

    @staticmethod
    def forward(ctx, x, dropped, scale):
        ctx.save_for_backward(dropped)
        ctx.scale = scale
        return x.mul(scale).masked_fill_(dropped, 0.0)

    @staticmethod
    def backward(ctx, grad):
        (dropped,) = ctx.saved_tensors
        return grad.mul(ctx.scale).masked_fill_(dropped, 0.0), None, None
