"""A config that crashes a shared torchrun job fails its own tests only (tests/torchrun_checks.py
`isolated`, `Shared`): one that raises on every rank is recorded and the job goes on; one that kills a
rank ends the job, which starts again without it. The others' results stand either way."""

from __future__ import annotations

from pathlib import Path

import pytest
from beside import beside
from torchrun_checks import TINY, Crashed, CrashedConfig, Shared, in_flight

# one training step's FLOPs each (the cheapest suite): two good configs around two that crash
CONFIGS = {
    "ok_before": TINY,
    "raises": [*TINY, "parallel.tp=3"],  # T 3 on 2 ranks: every rank raises building its groups
    "dies": TINY,  # rank 1 exits in it (TPBENCH_TEST_KILL_RANK1_AT)
    "ok_after": [*TINY, "parallel.sp=true"],
}


@beside
def crashed(folder: Path) -> tuple[list, list]:
    job = Shared(2)
    job.add("flops", "crash", CONFIGS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPBENCH_TEST_KILL_RANK1_AT", "crash/dies")
        ranks = job.part(folder, "flops", "crash")
    return ranks, in_flight(folder / "shared_w2.json")


def test_the_good_configs_results_stand_beside_the_crashed_ones(crashed):
    ranks, _ = crashed
    for rank in ranks:
        assert rank["ok_before"]["local"] > 0 and rank["ok_after"]["local"] > 0
        assert rank["ok_before"]["local"] == ranks[0]["ok_before"]["local"]
        assert not isinstance(rank["ok_after"], Crashed)  # begun by a rank as the job broke: run again


def test_a_config_that_raises_fails_where_it_is_read_saying_why(crashed):
    ranks, _ = crashed
    for r, rank in enumerate(ranks):
        assert isinstance(rank["raises"], Crashed)
        with pytest.raises(CrashedConfig, match=rf"(?s)rank {r}: .*world size 2 != dp 1 x tp 3"):
            rank["raises"]["local"]


def test_a_config_that_kills_a_rank_is_left_out_of_a_second_launch(crashed):
    ranks, running_at_the_end = crashed
    assert running_at_the_end == []  # the second launch ran to its end
    for rank in ranks:
        with pytest.raises(CrashedConfig, match="it ended the 2-rank job"):
            rank["dies"].get("local")
