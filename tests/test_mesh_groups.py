"""One mesh per layout in a real job: this file, run by torchrun over gloo on 4 ranks, builds the
contexts of several layouts twice, as a job's runs do one after another (tpbench.parallel.context), and
reports per rank the groups each made, their ranks and timeouts, and an all-reduce over each.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        tests/test_mesh_groups.py OUT.json

A layout's second pass makes no group and gets the very same mesh and groups; HSDP's layouts share the
(dp, tp) layout's TP and DP groups; every group a rank holds waits tpbench's timeout, not torch's 30
minutes (the kv_head dim, which nothing uses, is the fake backend's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from beside import beside
from torch.distributed import distributed_c10d as c10d

from tpbench.parallel.context import ParallelContext

WORLD, TIMEOUT = 4, timedelta(seconds=42)
LAYOUTS = {  # name: tp, dp, dp_replicate, KV heads (tp > N_kv: KV replica groups)
    "tp4_kv2": (4, 1, 1, 2),
    "tp2_dp2_kv1": (2, 2, 1, 1),
    "dp4": (1, 4, 1, 8),
    "hsdp_2x2": (1, 4, 2, 8),
    "hsdp_4x1": (1, 4, 4, 8),
}


def _groups(ctx: ParallelContext) -> dict[str, dist.ProcessGroup]:
    groups = {"tp": ctx.tp_group, "dp": ctx.dp_group}
    if ctx.kv_replica_group is not None:
        groups["kv_replica"] = ctx.kv_replica_group
    if ctx.dp_replicate > 1:
        groups |= {dim: ctx.fsdp_mesh.get_group(dim) for dim in ("dp_replicate", "dp_shard")}
    return groups


def job() -> dict:
    """This rank's report: per pass the groups made, per layout its groups' ranks, the all-reduced sum
    of ones over each, and whether the second pass got the very objects of the first."""
    made = []
    new_group = c10d._new_group_with_tag
    c10d._new_group_with_tag = lambda *a, **k: made.append(1) or new_group(*a, **k)
    passes = []
    for _ in range(2):
        before = len(made)
        built = {}
        for name, (tp, dp, replicate, kv_heads) in LAYOUTS.items():
            ctx = ParallelContext.of_world(tp, dp, torch.device("cpu"), TIMEOUT, replicate)
            ctx.setup_kv_replicas(kv_heads)
            built[name] = ctx
        passes.append((len(made) - before, built))
    (made_first, first), (made_again, again) = passes
    report: dict = {"made": [made_first, made_again], "layouts": {}}
    for name, ctx in first.items():
        groups, later = _groups(ctx), again[name]
        same = [getattr(ctx, f) is getattr(later, f) for f in ("mesh", "tp_mesh", "fsdp_mesh")]
        same += [g is _groups(later)[dim] for dim, g in groups.items()]
        sums = {}
        for dim, group in groups.items():
            ones = torch.ones(1)
            dist.all_reduce(ones, group=group)
            sums[dim] = int(ones.item())
        report["layouts"][name] = {
            "ranks": {dim: dist.get_process_group_ranks(g) for dim, g in groups.items()},
            "sums": sums,
            "same_objects": all(same),
            "mesh_dims": list(ctx.mesh.mesh_dim_names),
        }
    held = [g for g in c10d._world.pg_map if g is not dist.group.WORLD]
    report["held"] = sorted(([dist.get_backend(g), _timeout_s(g)] for g in held), key=str)
    return report


def _timeout_s(group: dist.ProcessGroup) -> float | None:
    options = group._get_backend(torch.device("cpu")).options  # None: the fake backend's, unused
    return options._timeout.total_seconds() if options is not None else None


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    torch.set_num_threads(1)
    mine = job()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


# --- the assertions: the job beside the tests ---------------------------------------------------------


@beside
def ranks(folder: Path) -> list[dict]:
    out = folder / "groups.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([*cmd, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_layout_s_second_run_makes_no_group_and_gets_the_same_ones(ranks):
    for rank, report in enumerate(ranks):
        assert report["made"][1] == 0, rank
        assert all(layout["same_objects"] for layout in report["layouts"].values()), rank


def test_each_dim_s_group_holds_the_ranks_the_layout_says(ranks):
    """rank = d * tp + t; HSDP's DP rank d = r * dp_shard + s; a KV head on tp / N_kv adjacent ranks.
    Each group's all-reduce of ones sums to its size: every rank took part in the same groups."""
    one_each, all4 = [[r] for r in range(4)], [[0, 1, 2, 3]] * 4
    pairs, across = [[0, 1]] * 2 + [[2, 3]] * 2, [[0, 2], [1, 3]] * 2
    expected = {
        "tp4_kv2": {"tp": all4, "dp": one_each, "kv_replica": pairs},
        "tp2_dp2_kv1": {"tp": pairs, "dp": across, "kv_replica": pairs},
        "dp4": {"tp": one_each, "dp": all4},
        "hsdp_2x2": {"tp": one_each, "dp": all4, "dp_replicate": across, "dp_shard": pairs},
        "hsdp_4x1": {"tp": one_each, "dp": all4, "dp_replicate": all4, "dp_shard": one_each},
    }
    for name, dims in expected.items():
        for rank, report in enumerate(ranks):
            layout = report["layouts"][name]
            assert layout["ranks"] == {dim: per_rank[rank] for dim, per_rank in dims.items()}, (name, rank)
            assert layout["sums"] == {dim: len(per_rank[rank]) for dim, per_rank in dims.items()}, (
                name,
                rank,
            )
        hsdp_dims = ["dp_replicate", "dp_shard", "tp"] if name.startswith("hsdp") else ["dp", "tp"]
        assert ranks[0]["layouts"][name]["mesh_dims"] == hsdp_dims


def test_every_group_a_rank_holds_waits_tpbench_s_timeout(ranks):
    """Gloo's groups all wait the job's timeout; the fake ones are the unused kv_head dims (one per
    layout with KV replicas)."""
    for report in ranks:
        gloo = [timeout for backend, timeout in report["held"] if backend == "gloo"]
        assert gloo and set(gloo) == {TIMEOUT.total_seconds()}
        assert [b for b, _ in report["held"] if b != "gloo"] == ["fake", "fake"]


if __name__ == "__main__":
    main(sys.argv[1])
