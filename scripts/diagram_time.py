"""Time the trace and drawing of one block, as the report's diagram section makes it for a run:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/diagram_time.py [overrides...]

(default: model=qwen3_0_6b tp=4 sp=true kind=memory). Prints wall and CPU seconds and the max RSS."""

from __future__ import annotations

import resource
import sys
import time

from tpbench import diagram
from tpbench.run.compose import expand


def main(overrides: list[str]) -> None:
    overrides = overrides or ["model=qwen3_0_6b", "tp=4", "sp=true", "kind=memory"]
    (cfg,) = expand(overrides, single=True)
    cfg.parallel.dp = 1  # as the report's section traces it
    wall, cpu = time.perf_counter(), time.process_time()
    traced = diagram.trace(diagram.traceable(cfg))
    diagram.render([traced], "svg")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"{' '.join(overrides)}: traced and drawn in {time.perf_counter() - wall:.1f} s wall, "
        f"{time.process_time() - cpu:.1f} s CPU; {len(traced.ranks[0].collectives)} collectives a rank; "
        f"max RSS {rss:.1f} GiB"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
