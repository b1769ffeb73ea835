"""The quick tier's one parallel launch: the inner loop for the parallel code (`pytest -m quick`).

One real torchrun job over gloo, started by the test itself (the quick tier runs under pytest-xdist,
where no job beside the tests starts: tests/beside.py), validates TP + SP + VP at T 2 with DP 2 on 4
ranks, the parallel model of every kind the whole suite checks in one, beside one planted bug: the SP
norms' gradient sum skipped. The correct model passes every check; the planted one fails exactly the
gradients that need the skipped sum (tests/torchrun_checks.py BREAKS) and passes every other. The
whole suite checks each mode, engine and DP level apart (tests/test_parallel.py and its neighbours).
"""

from __future__ import annotations

import re

from torchrun_checks import BREAKS, CHECKS, TINY, TOL_GRAD, per_config, torchrun

from tpbench.experiments.criterion import K

MODEL = ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", "parallel.vp=true"]
PLANT = "debug.skip_grad_sum=[sp_norms]"
CONFIGS = {"tp_sp_vp_dp2": [*TINY, *MODEL], "tp_sp_vp_dp2_no_sp_norm_sum": [*TINY, *MODEL, PLANT]}


def test_one_launch_validates_tp_sp_vp_dp2_and_catches_a_planted_bug(tmp_path):
    ranks = torchrun(CHECKS, 4, tmp_path / "inner.json", "validate", checks=CONFIGS, timeout=300)
    results = per_config(ranks)
    good, planted = (results[name] for name in CONFIGS)
    assert len(good) == 4 and len(planted) == 4
    assert [rank["metrics"]["passed"] for rank in good] == [1.0] * 4  # every rank's verdict
    assert good[0]["failed"] == []  # rank 0's lines: what the database records

    breaks = re.compile(BREAKS[PLANT])
    rows = planted[0]["params"]  # rank 0's rows: each the worst over the 4 ranks
    failing = {n for n, (error, reference) in rows.items() if error > K * reference + TOL_GRAD}
    assert failing == {n for n in rows if breaks.search(n)} and failing
    assert all(rank["metrics"]["passed"] == 0.0 for rank in planted)
    (line,) = [f for f in planted[0]["failed"] if f.startswith("grad_rel_l2 ")]
    assert breaks.search(line.split()[1]), line
