"""What a CPU core's memory does to a training step's kernels, one thread, by CPU time:
- where its elementwise bandwidth falls off: an add of three operands of each size, hot (the same
  operands again and again, as the time model's first bandwidth probe timed 3 x 16 MiB) and cold
  (after writing a buffer of twice the last-level cache Linux names), beside the probe
  tpbench.predict.rate_probe now takes (three operands of twice that cache together);
- what cold operands add to a GEMM: the GEMMs of the grid's H 256 and H 768 TP steps, hot (one set
  of operands and result again and again) and cold (a new set each call, the sets together beyond
  the cache, as a step's weights, activations and results are), beside hot + bytes / the probe's
  bandwidth (the time model's GEMM on a CPU) and the larger of the two (the roofline's);
- two of the step's own ops at H 256 (micro-batch 2, S 256), hot and cold beside the time model's
  op (at the probed bandwidth and per-op cost): MiniMind's RMSNorm forward and backward, and the
  cross-entropy's log-softmax over [512, 6,400] logits forward, per element, beside an add's.
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_bandwidth.py
Takes about a minute and 1.5 GiB of memory at most on a CPU with a large cache."""

import time

import torch

from tpbench.models.minimind import RMSNorm
from tpbench.predict import rate_probe
from tpbench.predict.steptime import Rates, model
from tpbench.predict.steptime import ops as O

SIZES_MIB = (1, 4, 16, 64, 256)


def gbps(operand_bytes: int, seconds: float) -> float:
    return 3 * operand_bytes / seconds / 1e9


def main() -> None:
    torch.set_num_threads(1)
    llc = rate_probe.last_level_cache_bytes()
    print(f"last-level cache Linux names: {llc / 2**20:.0f} MiB" if llc else "no cache size named")
    probed = rate_probe.probe_time_rates(1)  # the time model's rates: memory's bandwidth, the per-op cost
    flush = torch.empty(min(2 * (llc or 2**26), 2**30) // 4)
    print("operand   hot GB/s   cold GB/s")
    for mib in SIZES_MIB:
        n = mib * 2**20 // 4
        a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
        torch.add(a, b, out=c)
        reps = max(3, 1024 // mib)
        start = time.process_time()
        for _ in range(reps):
            torch.add(a, b, out=c)
        hot = (time.process_time() - start) / reps
        cold = []
        for _ in range(3):
            flush.fill_(1.0)
            start = time.process_time()
            torch.add(a, b, out=c)
            cold.append(time.process_time() - start)
        print(f"{mib:4d} MiB  {gbps(4 * n, hot):8.1f}  {gbps(4 * n, sorted(cold)[1]):9.1f}")
    bandwidth = probed["bandwidth"]
    print(f"the probe (rate_probe._memory_bandwidth): {bandwidth / 1e9:.1f} GB/s")
    print("GEMM [m, k] @ [k, n]        hot ms  cold ms  hot + bytes/bw  max(hot, bytes/bw)")
    for m, n, k in GEMMS:
        hot, cold, size = gemm_times(m, n, k)
        traffic = size / bandwidth * 1e3
        line = f"[{m}, {k}] @ [{k}, {n}]".ljust(27)
        print(f"{line}{hot:7.3f} {cold:8.3f} {hot + traffic:15.3f} {max(hot, traffic):19.3f}")

    step_ops(bandwidth, probed["op_s"], flush)


def step_ops(bandwidth: float, op_s: float, flush: torch.Tensor) -> None:
    """The step's ops hot and cold (`flush` written between) beside the time model's figures."""
    norm, x, g = RMSNorm(256), torch.randn(256, 2, 256, requires_grad=True), torch.randn(256, 2, 256)
    logits, add = torch.randn(512, 6400), torch.randn(512, 6400)
    rates = Rates({}, 0.0, bandwidth, op_s, {}, {})
    forward = O.rmsnorm("norm", 512, 256, 4)
    predicted = sum(sum(model.op_time(op, rates)) for op in (forward, O.backward_of(forward)))
    cases = (
        ("RMSNorm [512, 256] forward and backward, ms", lambda: norm(x).backward(g), 1e3, predicted * 1e3),
        (
            "log-softmax [512, 6400] forward, ns an element",
            lambda: torch.log_softmax(logits, -1),
            1e9 / 512 / 6400,
            16 / bandwidth * 1e9,
        ),
        (
            "add [512, 6400], ns an element",
            lambda: torch.add(add, add),
            1e9 / 512 / 6400,
            12 / bandwidth * 1e9,
        ),
    )
    print("op                                                hot     cold  the model")
    for name, fn, scale, model_figure in cases:
        fn()
        hot, cold = [], []
        for _ in range(7):
            start = time.process_time()
            fn()
            hot.append(time.process_time() - start)
            flush.fill_(1.0)
            start = time.process_time()
            fn()
            cold.append(time.process_time() - start)
        print(f"{name:48s} {sorted(hot)[3] * scale:6.2f} {sorted(cold)[3] * scale:8.2f} {model_figure:10.2f}")


# the linear layers' GEMMs at H 256 (I 832 at T 1 and 416 at T 2, the head's V 6,400) and H 768
GEMMS = (
    (512, 832, 256),
    (512, 256, 832),
    (512, 416, 256),
    (512, 256, 256),
    (512, 6400, 256),
    (1024, 2048, 768),
)


def gemm_times(m: int, n: int, k: int) -> tuple[float, float, int]:
    """(hot ms, cold ms, bytes) of x [m, k] @ w [n, k]^T, as a linear layer runs it."""
    size = 4 * (m * k + n * k + m * n)
    copies = max(4, 2**28 // size)  # 256 MiB of sets
    sets = [(torch.randn(m, k), torch.randn(n, k), torch.empty(m, n)) for _ in range(copies)]

    def loop(chosen) -> float:
        start = time.process_time()
        for x, w, out in chosen:
            torch.mm(x, w.t(), out=out)
        return (time.process_time() - start) / len(chosen) * 1e3

    hot_sets = [sets[0]] * copies
    loop(hot_sets), loop(sets)
    hot = sorted(loop(hot_sets) for _ in range(5))[2]
    cold = sorted(loop(sets) for _ in range(5))[2]
    return hot, cold, size


if __name__ == "__main__":
    main()
