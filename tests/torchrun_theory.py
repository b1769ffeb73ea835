"""The analytic model's checks that need real ranks, run inside one torchrun job; rank 0 writes JSON.

    TPBENCH_CHECKS='{"tp": ["parallel.tp=2"]}' torchrun --nproc-per-node 2 tests/torchrun_theory.py OUT

For each config: the memory experiment (warm-up, one counted step, measured steps under MemTracker).
Records the collectives counted on every rank and every rank's measured peak; the assertions, and the
predictions they compare with, live in tests/test_theory.py.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tpbench.config import RunConfig
from tpbench.experiments import memory


def run_config(overrides: list[str]) -> RunConfig:
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist(overrides))
    cfg = OmegaConf.to_object(merged)
    cfg.launch.device = "cpu"
    return cfg


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for name, overrides in json.loads(os.environ["TPBENCH_CHECKS"]).items():
        r = memory.run(run_config(overrides))
        mine = {
            "peak": next(m.value for m in r.measurements if m.name == "peak_bytes"),
            "comm": sorted([c.op, c.purpose, c.count, c.bytes] for c in r.comm),
        }
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        results[name] = ranks
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
