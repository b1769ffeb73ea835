"""The CUDA path without a GPU: tpbench's own training step (forward, backward, the gradient sums,
AdamW) of every mode and switch on fake CUDA tensors over torch's `cuda:fake` backend, which refuses a
CPU tensor in a collective as NCCL does (tests/fake_cuda_checks.py runs it, in one subprocess with the
no-op CUDA of tests/cuda_guard preloaded; this process never loads it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cuda_guard
import pytest
import torch
from beside import beside
from fake_cuda_checks import CASES, MODES

CHECKS = Path(__file__).with_name("fake_cuda_checks.py")
SP_OPS = {"_allgather_base_.default", "_reduce_scatter_base_.default", "allreduce_.default"}
DTENSOR_SP_OPS = {"all_gather_into_tensor.default", "reduce_scatter_tensor.default", "all_reduce.default"}


@beside
def fake_cuda(folder: Path) -> dict:
    if torch.version.cuda is not None:  # a CUDA torch has CUDA's guard and hooks: scripts/gpu-check.sh
        pytest.skip("torch is built with CUDA: the no-op CUDA is for a CPU-only torch")
    start = time.perf_counter()
    so = cuda_guard.build()
    built = time.perf_counter() - start
    out = folder / "out.json"
    tests = str(Path(__file__).parent)
    path = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **cuda_guard.preload(so))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(CHECKS), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    results["timing"] = {"build_s": built, "checks_s": time.perf_counter() - start}
    return results


def test_no_case_failed(fake_cuda):
    assert fake_cuda["errors"] == {}
    assert set(fake_cuda["cases"]) == {"reductions", *CASES}


def test_every_mode_ran():
    assert {name.split("/")[0].split("+")[0] for name in CASES} == set(MODES)
    assert {"dtensor_tp", "tp_sp_linear", "tp_sp_vp"} <= set(MODES)


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_on_cuda(fake_cuda, case):
    seen = fake_cuda["cases"].get(case)
    assert seen is not None, fake_cuda["errors"].get(case)
    assert seen["device"] == "cuda:0" and seen["loss"] == ["cuda"]
    assert seen["params"] == seen["grads"] == ["cuda"]
    assert seen["grads_missing"] == 0
    assert seen["optimizer_states"] == seen["params_count"]
    fused = "fused_adamw" in case
    assert (seen["foreach"], seen["fused"]) == ((None, True) if fused else (True, None))
    # AdamW's step counters stay on the host unless fused
    assert seen["optimizer"] == {
        "exp_avg": ["cuda"],
        "exp_avg_sq": ["cuda"],
        "step": ["cuda" if fused else "cpu"],
    }
    assert seen["mixed"] == seen["build_mixed"] == []  # no op was handed CPU and CUDA tensors
    assert seen["to_host"] == []  # nothing copied to the host (a GPU would wait for it)
    assert seen["collectives"], "no collective issued"
    assert all(devices == ["cuda"] for _, devices in seen["collectives"] + seen["build_collectives"])
    # the only CPU tensors made are the batches' (seeded on the host, then made on the device)
    assert seen["cpu_made"] == seen["cpu_made_by_batches"]


@pytest.mark.parametrize("case", [c for c in CASES if "_sp" in c])
def test_every_collective_of_sp_issued_on_cuda(fake_cuda, case):
    ops = {op for op, _ in fake_cuda["cases"][case]["collectives"]}
    assert (DTENSOR_SP_OPS if case.startswith("dtensor") else SP_OPS) <= ops


def test_metric_reductions_of_validate_and_throughput_on_cuda(fake_cuda):
    seen = fake_cuda["cases"]["reductions"]
    # validate's drift at a compared step, its figures' worst and per-parameter worst, throughput's FLOPs sum
    assert len(seen["collectives"]) == 4
    assert all(devices == ["cuda"] for _, devices in seen["collectives"])
    assert seen["mixed"] == []


def test_this_process_has_no_cuda():
    """The no-op CUDA lives in the check's subprocess only."""
    if torch.version.cuda is None:
        assert torch._C._accelerator_getAccelerator() is None
    assert not torch.cuda.is_available() or torch.version.cuda is not None
