"""What the CUDA caching allocator would hold for a trace of tensor allocations: its peak allocated and
reserved bytes, without a GPU.

`torch.cuda.max_memory_allocated` counts allocator blocks, not tensors: every allocation is rounded up,
and a cached block is split only when enough of it would remain, the whole block counting as allocated
otherwise. The rules below are those of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x, default
settings: no max_split_size, no expandable segments), per stream:

  round_size        sizes round up to a multiple of 512 B (kMinBlockSize)
  pools             <= 1 MiB (kSmallSize) from the small pool, larger ones from the large pool; a
                    block serves only allocations on the stream it was allocated on (the pools'
                    order is (stream, size, address)), so each stream has its own two pools and
                    its own segments
  new segments      small: 2 MiB (kSmallBuffer); large under 10 MiB (kMinLargeAlloc): 20 MiB
                    (kLargeBuffer); larger: the size rounded up to 2 MiB (kRoundLarge)
  best fit          the smallest cached block of the pool that is large enough (then the lowest address)
  split             small pool: when >= 512 B would remain; large pool: when > 1 MiB would remain
  free              the block returns to its pool, merged with free neighbours of its segment; segments
                    are never given back (no empty_cache)

With `expandable` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which torchtitan's launch script
sets: run_llama_train.sh since a5e57e4, 2024-10-22; run_train.sh) each pool of each stream is one
segment of reserved address space, mapped in pages (2 MiB in the small pool, 20 MiB in the large) as
it grows: when no cached block fits, the pages the request needs are mapped at the segment's end,
joined to its last block if that one is free (try_allocate_expandable_block); reserved bytes are the
mapped pages. Blocks split and merge as above; a free block inside the segment still serves only
requests it fits.

cuBLAS keeps one workspace per (handle, stream), allocated through the same allocator on the first GEMM
and kept: a training step runs GEMMs on two threads (the forward on the caller's, backward on
autograd's device thread), so two handles and two workspaces (PyTorch's CUBLAS_WORKSPACE_CONFIG
default, :4096:2:16:8 = 8 MiB + 128 KiB, and :4096:8 = 32 MiB on Hopper).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from tpbench.predict import hardware

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

# GPU (a family, a row of tpbench.predict.hardware or an alias) -> its compute capability major: what the
# cuBLAS workspace size depends on
GPUS = {name: hardware.cuda_major(name) for name in hardware.allocator_names()}
CUBLAS_HANDLES = 2  # the forward's thread and autograd's device thread


def gpu_of(device_name: str) -> str | None:
    """The family a device name ("NVIDIA H100 80GB HBM3": H100) names, or None."""
    return hardware.family_of(device_name)


def cublas_workspace_bytes(gpu: str) -> int:
    """PyTorch's default cuBLAS workspace for one handle and stream on this GPU."""
    return 4096 * 8 * 1024 if GPUS[gpu] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * math.ceil(size / MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)


@dataclass(eq=False)
class Block:
    segment: int
    offset: int
    size: int
    small: bool
    stream: int = 0
    free: bool = True
    prev: Block | None = None
    next: Block | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        """The pool's order: size, then address (segments in the order they were made)."""
        return (self.size, self.segment, self.offset)


@dataclass
class CachingAllocator:
    """Replays allocations and frees; tracks allocated and reserved bytes and their peaks."""

    # (stream, small) -> the free blocks of that pool, in order
    pools: dict[tuple[int, bool], list[tuple[tuple[int, int, int], Block]]] = field(default_factory=dict)
    segments: int = 0
    expandable: bool = False
    tails: dict[tuple[int, bool], Block] = field(default_factory=dict)  # expandable: each pool's last block
    allocated: int = 0
    reserved: int = 0
    stream_reserved: dict[int, int] = field(default_factory=dict)  # of `reserved`, each stream's
    peak_allocated: int = 0
    peak_reserved: int = 0

    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take((stream, small), size)
        if block is None and self.expandable:
            block = self._grow((stream, small), size)
        elif block is None:  # cudaMalloc a new segment
            seg = segment_size(size)
            block = Block(self.segments, 0, seg, small, stream)
            self.segments += 1
            self.reserved += seg
            self.stream_reserved[stream] = self.stream_reserved.get(stream, 0) + seg
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = Block(
                block.segment, block.offset + size, remaining, small, stream, True, block, block.next
            )
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._put(rest)
            if self.tails.get((stream, small)) is block:
                self.tails[(stream, small)] = rest
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: Block) -> None:
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        if self.expandable and block.next is None:  # the one segment's end
            self.tails[(block.stream, block.small)] = block
        self._put(block)

    def _grow(self, pool_key: tuple[int, bool], size: int) -> Block:
        """Expandable segments: map the pages `size` needs at the end of the pool's segment, joined
        to its last block when that one is free."""
        stream, small = pool_key
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self.tails.get(pool_key)
        if tail is None:
            self.segments += 1
        if tail is not None and tail.free:
            self._remove(tail)
            mapped = page * math.ceil((size - tail.size) / page)
            tail.size += mapped
            block = tail
        else:
            mapped = page * math.ceil(size / page)
            segment = self.segments - 1 if tail is None else tail.segment
            offset = 0 if tail is None else tail.offset + tail.size
            block = Block(segment, offset, mapped, small, stream, True, tail, None)
            if tail is not None:
                tail.next = block
            self.tails[pool_key] = block
        self.reserved += mapped
        self.stream_reserved[stream] = self.stream_reserved.get(stream, 0) + mapped
        return block

    def reset_peaks(self) -> None:
        """As torch.cuda.reset_peak_memory_stats: the peaks restart from what is held now."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _take(self, pool_key: tuple[int, bool], size: int) -> Block | None:
        pool = self.pools.setdefault(pool_key, [])
        i = bisect.bisect_left(pool, (size, -1, -1), key=lambda entry: entry[0])
        if i == len(pool):
            return None
        return pool.pop(i)[1]

    def _put(self, block: Block) -> None:
        pool = self.pools.setdefault((block.stream, block.small), [])
        bisect.insort(pool, (block.key, block), key=lambda entry: entry[0])

    def _remove(self, block: Block) -> None:
        pool = self.pools[(block.stream, block.small)]
        i = bisect.bisect_left(pool, block.key, key=lambda entry: entry[0])
        assert pool[i][1] is block
        pool.pop(i)


@dataclass
class AllocatorPeaks:
    allocated: int
    reserved: int


def replay(events: list[tuple], gpu: str, expandable: bool = False) -> AllocatorPeaks:
    """Peaks of the measured window of an allocation trace (tpbench.parallel.emulation.AllocationTrace):
    events are ("alloc", token, bytes[, stream]) (stream 0, the default, when absent), ("free", token)
    and one ("window",) where the measured steps begin. The cuBLAS workspaces are allocated at the
    first GEMM, during warm-up, and held (on the default stream: FSDP2 runs no GEMM on its own)."""
    allocator = CachingAllocator(expandable=expandable)
    live: dict[int, Block] = {}
    for event in events:
        if event[0] == "alloc":
            live[event[1]] = allocator.malloc(event[2], event[3] if len(event) > 3 else 0)
        elif event[0] == "free":
            block = live.pop(event[1], None)
            if block is not None:
                allocator.free(block)
        elif event[0] == "gemm_workspaces":
            for _ in range(CUBLAS_HANDLES):
                allocator.malloc(cublas_workspace_bytes(gpu))
        elif event[0] == "window":
            allocator.reset_peaks()
    return AllocatorPeaks(allocator.peak_allocated, allocator.peak_reserved)
