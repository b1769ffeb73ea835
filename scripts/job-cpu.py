"""Where a torchrun job of the tests spends its CPU: per config, summed over its ranks.

    .venv/bin/python scripts/job-cpu.py FOLDER [--top N]

Reads every OUT.cpu.json under FOLDER (tests/torchrun_checks.py writes one beside each job's results;
run pytest with `--basetemp FOLDER` to keep them in a known place) and prints, per job: each rank's
imports and total CPU seconds, the CPU per suite and per test module's prefix, and the N costliest
configs (CPU summed over the ranks, and the slowest rank's wall seconds).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in sorted(args.folder.rglob("*.cpu.json")):
        ranks = json.loads(path.read_text())
        starts, totals = (sum(r[k] for r in ranks) for k in ("start_cpu_s", "total_cpu_s"))
        print(f"{path}: {len(ranks)} ranks, {totals:.1f} CPU s in all, {starts:.1f} of it importing")
        cpu, wall, groups = Counter(), Counter(), Counter()
        for rank in ranks:
            for suite, configs in rank["suites"].items():
                for name, (c, w) in configs.items():
                    cpu[f"{suite}:{name}"] += c
                    wall[f"{suite}:{name}"] = max(wall[f"{suite}:{name}"], w)
                    groups[f"{suite}:{name.split('/')[0] if '/' in name else ''}"] += c
        for group, c in groups.most_common():
            print(f"  {c:8.1f} CPU s  {group}")
        print(f"  the {args.top} costliest configs (CPU s over the ranks, wall s of the slowest rank):")
        for key, c in cpu.most_common(args.top):
            print(f"  {c:8.1f} {wall[key]:7.1f}  {key}")


if __name__ == "__main__":
    main()
