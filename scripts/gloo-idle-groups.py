"""What idle gloo process groups cost a rank: N groups made (each used once), kept or destroyed, then
10 s of sleep, and the rank's CPU seconds (user, sys) and threads over that sleep.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        scripts/gloo-idle-groups.py 50 keep        (or: 50 destroy)

tests/torchrun_checks.py destroys each config's groups once it is done (`release_groups`) for this.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    n, destroy = int(sys.argv[1]), sys.argv[2] == "destroy"
    dist.init_process_group("gloo")
    for _ in range(n):
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(4), group=group)
        if destroy:
            dist.barrier()
            dist.destroy_process_group(group)
    del group
    dist.barrier()
    before = os.times()
    time.sleep(10)
    after = os.times()
    threads = len(os.listdir("/proc/self/task"))
    print(
        f"rank {dist.get_rank()}: {n} groups {'destroyed' if destroy else 'kept'}, {threads} threads, "
        f"10 s asleep cost {after.user - before.user:.2f} s user, {after.system - before.system:.2f} s sys",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
