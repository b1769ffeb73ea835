"""The CUDA path without a GPU, on torch's `cuda:fake` backend (see tests/fake_cuda_checks.py for what a
CPU-only torch can and cannot run there): every collective tpbench issues is on a CUDA tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from beside import beside

CHECKS = Path(__file__).with_name("fake_cuda_checks.py")


@beside
def fake_cuda(folder: Path) -> dict:
    out = folder / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(CHECKS), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_no_check_failed(fake_cuda):
    assert fake_cuda["errors"] == {}


def test_metric_reductions_of_validate_and_throughput_on_cuda(fake_cuda):
    collectives = fake_cuda["modes"]["reductions"]["collectives"]
    assert len(collectives) == 3  # validate's max and per-parameter worst, throughput's FLOPs sum
    assert all(devices == ["cuda"] for _, devices in collectives)


@pytest.mark.parametrize("mode", ["tp", "tp_sp", "tp_vp", "tp_sp_vp", "tp_sp_vp_kv1"])
@pytest.mark.parametrize("precision", ["bf16_pure", "bf16_mixed"])
def test_every_collective_of_a_mode_on_cuda(fake_cuda, mode, precision):
    seen = fake_cuda["modes"][f"{mode}/{precision}"]
    ops = {op for op, _ in seen["collectives"]}
    assert {"allreduce_.default", "_allgather_base_.default", "_reduce_scatter_base_.default"} <= ops
    assert all(devices == ["cuda"] for _, devices in seen["collectives"]), seen["collectives"]
    assert seen["params"] == ["cuda"]
    assert seen["autocast_device"] == ("cuda" if precision == "bf16_mixed" else None)
