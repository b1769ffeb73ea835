"""What pipelining a collective with its GEMM (Megatron's userbuffers, PyTorch's async TP) can hide on
this machine: gloo, two ranks, one core each, at the TP step's shapes (H 768, I 2432 as MiniMind makes it
from H, T 2, N = S*B = 1024).

- TP's row-parallel exit: down's GEMM [N, I/T] x [I/T, H], then the all-reduce of its output; pipelined,
  the GEMM runs in row chunks and each chunk's all-reduce is launched as soon as the chunk is made.
- SP's row-parallel exit: the same GEMM, then the reduce-scatter of its output over the sequence;
  pipelined, the GEMM runs in two column halves, each half reduce-scattered as soon as it is made
  (gloo has no reduce-scatter per destination row to start earlier), the halves joined after.
- SP's entry: the all-gather of the normed shard [N/T, H], then gate's GEMM [N, H] x [H, I/T];
  pipelined, the all-gather is launched and the local shard's rows are multiplied while it runs.

Per iteration: the median wall time, and the CPU time of all the rank's threads (its compute and
gloo's workers) over the loop's wall time. The pipelined results are checked bit-equal to the
blocking ones. Each case runs `--reps` times, interleaved; rank 0 prints the medians.

Run: OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/overlap_bound.py
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from tpbench.models.minimind import default_intermediate_size

N, H, T = 1024, 768, 2
I = default_intermediate_size(H)  # noqa: E741


def row_exit_blocking(x, w):
    y = x @ w.t()  # [N, I/T] x [I/T, H]
    dist.all_reduce(y)
    return y


def row_exit_pipelined(x, w, chunks):
    y = torch.empty(x.shape[0], w.shape[0])
    works = []
    for xs, ys in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
        torch.mm(xs, w.t(), out=ys)
        works.append(dist.all_reduce(ys, async_op=True))
    for work in works:
        work.wait()
    return y


def sp_exit_blocking(x, w):
    y = x @ w.t()
    out = torch.empty(y.shape[0] // T, y.shape[1])
    dist.reduce_scatter_single(out, y)
    return out


def sp_exit_pipelined(x, w):
    halves, works = [], []
    for w_half in w.chunk(2):  # output columns
        y = x @ w_half.t()
        out = torch.empty(y.shape[0] // T, y.shape[1])
        works.append(dist.reduce_scatter_single(out, y, async_op=True))
        halves.append(out)
    for work in works:
        work.wait()
    return torch.cat(halves, dim=1)


def sp_entry_blocking(shard, w):
    full = torch.empty(shard.shape[0] * T, shard.shape[1])
    dist.all_gather_single(full, shard)
    return full @ w.t()  # [N, H] x [H, I/T]


def sp_entry_pipelined(shard, w):
    full = torch.empty(shard.shape[0] * T, shard.shape[1])
    work = dist.all_gather_single(full, shard, async_op=True)
    y = torch.empty(full.shape[0], w.shape[0])
    rank, rows = dist.get_rank(), shard.shape[0]
    torch.mm(shard, w.t(), out=y.narrow(0, rank * rows, rows))  # the local rows, while gathering
    work.wait()
    for r in range(T):
        if r != rank:
            torch.mm(full.narrow(0, r * rows, rows), w.t(), out=y.narrow(0, r * rows, rows))
    return y


def timed(fn, iters):
    dist.barrier()
    walls = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return statistics.median(walls), cpu / wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    x, w_down = torch.randn(N, I // T), torch.randn(H, I // T)
    shard, w_gate = torch.randn(N // T, H), torch.randn(I // T, H)
    y = x @ w_down.t()
    cases = {
        "down GEMM alone": lambda: x @ w_down.t(),
        "all-reduce alone [N, H]": lambda: dist.all_reduce(y),
        "down + all-reduce, blocking": lambda: row_exit_blocking(x, w_down),
        "down + all-reduce, 2 chunks": lambda: row_exit_pipelined(x, w_down, 2),
        "down + all-reduce, 4 chunks": lambda: row_exit_pipelined(x, w_down, 4),
        "down + reduce-scatter, blocking": lambda: sp_exit_blocking(x, w_down),
        "down + reduce-scatter, 2 halves": lambda: sp_exit_pipelined(x, w_down),
        "gate GEMM alone [N, H]": lambda: shard.repeat(T, 1) @ w_gate.t(),
        "all-gather + gate, blocking": lambda: sp_entry_blocking(shard, w_gate),
        "all-gather + gate, pipelined": lambda: sp_entry_pipelined(shard, w_gate),
    }
    for chunks in (2, 4):
        assert torch.equal(row_exit_blocking(x, w_down), row_exit_pipelined(x, w_down, chunks))
    assert torch.equal(sp_exit_blocking(x, w_down), sp_exit_pipelined(x, w_down))
    assert torch.equal(sp_entry_blocking(shard, w_gate), sp_entry_pipelined(shard, w_gate))
    for fn in cases.values():  # warm-up
        timed(fn, 3)
    runs = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():
            runs[name].append(timed(fn, args.iters))
    if dist.get_rank() == 0:
        print(f"{'case':34s} {'ms / iteration':>15s} {'cores busy':>11s}   (medians of {args.reps})")
        for name, results in runs.items():
            ms = statistics.median(r[0] for r in results) * 1e3
            busy = statistics.median(r[1] for r in results)
            print(f"{name:34s} {ms:15.2f} {busy:11.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
