"""ZeRO-1's buckets (tpbench.parallel.zero), as Megatron's distributed optimizer forms them: the
parameters in reverse model order (the order backward makes their gradients), a bucket closed at a
parameter boundary once it holds the cap's elements, each padded to a multiple of DP so that every
rank owns 1/DP of each; the parameters whose gradients need a TP sum first (and a tied embedding) in
one late bucket, reduce-scattered after those sums.
"""

from __future__ import annotations

from dataclasses import dataclass

MEGATRON_BUCKET = 40_000_000  # elements: Megatron's bucket_size floor, max(40M, 1M x DP)


def bucket_cap(elements: int, dp: int) -> int:
    """parallel.zero_bucket_elements, or Megatron's default where it is 0: max(40M, 1M x DP)."""
    return elements or max(MEGATRON_BUCKET, 1_000_000 * dp)


@dataclass(frozen=True)
class Bucket:
    """One bucket of the flat buffers: its parameters (in buffer order), where it starts in [P], its
    elements padded to a multiple of DP, and whether it is the late one (reduce-scattered at
    finish_grads, after the TP gradient sums)."""

    names: tuple[str, ...]
    start: int
    numel: int  # B_b
    late: bool


def plan_buckets(numels: dict[str, int], late: set[str], cap: int, dp: int) -> list[Bucket]:
    """The buckets of parameters `numels` (name -> elements, in the model's order): the others in
    reverse order, a bucket closed once it holds `cap` elements, then the late ones in model order."""
    groups: list[tuple[list[str], bool]] = [([], False)]
    size = 0
    for name in reversed([n for n in numels if n not in late]):
        groups[-1][0].append(name)
        size += numels[name]
        if size >= cap:
            groups.append(([], False))
            size = 0
    groups.append(([n for n in numels if n in late], True))
    out, start = [], 0
    for names, is_late in groups:
        if not names:
            continue
        numel = -(-sum(numels[n] for n in names) // dp) * dp
        out.append(Bucket(tuple(names), start, numel, is_late))
        start += numel
    return out
