"""The per-rank ring bytes every collective is counted with (tpbench.parallel.instrumentation.ring_bytes),
the one formula CommCounter and the analytic model share, and how CommCounter adds them up."""

from __future__ import annotations

import pytest

from tpbench.parallel.instrumentation import CommCounter, CommEvent, ring_bytes


@pytest.mark.parametrize(
    ("op", "world", "wire"),
    [
        ("all_reduce", 4, 1536),  # 2(T-1)/T * N
        ("all_gather", 4, 768),  # (T-1)/T * N
        ("reduce_scatter", 4, 768),
        ("all_reduce", 2, 1024),
        ("all_gather", 2, 512),
        ("all_reduce", 3, 1365),  # 2/3 * 2048 = 1365.33, rounded per collective
        ("reduce_scatter", 3, 683),  # 2/3 * 1024 = 682.67
        ("all_reduce", 1, 0),  # a group of one sends nothing
    ],
)
def test_ring_bytes_per_rank(op: str, world: int, wire: int):
    assert ring_bytes(op, 1024, world) == wire


def test_counter_adds_ring_bytes_per_op_and_purpose_and_logs_each():
    counter = CommCounter(log=True)
    counter.record("all_reduce", "activation", 1024, 3, 0.0)
    counter.record("all_reduce", "activation", 1024, 3, 0.0)
    counter.record("all_gather", "regather", 4096, 4, 0.0, (8, 16), "torch.float32", (0, 1, 2, 3))
    rows = {(r.op, r.purpose): (r.count, r.bytes) for r in counter.rows()}
    assert rows == {("all_reduce", "activation"): (2, 2 * 1365), ("all_gather", "regather"): (1, 3072)}
    assert counter.events[-1] == CommEvent(
        "all_gather", "regather", (8, 16), "torch.float32", (0, 1, 2, 3), 3072
    )
    assert {(r.op, r.count, r.bytes) for r in counter.rows(steps=2)} == {
        ("all_reduce", 1, 1365),
        ("all_gather", 0, 1536),
    }
