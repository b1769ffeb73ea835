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
from fake_cuda_checks import CASES, MODES, SWITCHES
from torchrun_checks import TINY, run_config

from tpbench.predict import theory

pytestmark = pytest.mark.torch_build  # skips on a CUDA build of torch (ci_skips.py): benchmarks/gpu-check.sh
CHECKS = Path(__file__).with_name("fake_cuda_checks.py")
SP_OPS = {"_allgather_base_.default", "_reduce_scatter_base_.default", "allreduce_.default"}
DTENSOR_SP_OPS = {"all_gather_into_tensor.default", "reduce_scatter_tensor.default", "all_reduce.default"}


@beside
def fake_cuda(folder: Path) -> dict:
    if torch.version.cuda is not None:  # a CUDA torch has CUDA's guard and hooks: benchmarks/gpu-check.sh
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
                          timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    results["timing"] = {"build_s": built, "checks_s": time.perf_counter() - start}
    return results


def test_no_case_failed(fake_cuda):
    assert fake_cuda["errors"] == {}
    assert set(fake_cuda["cases"]) == {"reductions", *CASES}


def test_every_mode_and_switch_ran(fake_cuda):
    ran = [name.split("/")[0].split("+") for name in fake_cuda["cases"] if name != "reductions"]
    assert {mode for mode, *_ in ran} == set(MODES)
    assert {switch for _, *switches in ran for switch in switches} == set(SWITCHES)
    assert {"dtensor_tp_sp", "dtensor_tp_vp", "tp_sp_linear", "tp_sp_vp"} <= set(MODES)
    assert {"dropout", "no_regather", "recompute_full", "overlap"} <= set(SWITCHES)


def predicted_comm(case: str) -> list[list]:
    """The model's collectives for the case's config as [op, purpose, bytes] (the bytes of a step: how
    many calls carry them aside: the dtensor engine sums each replicated gradient on its own, overlap
    splits DP's). The model knows the dtensor engine's SP keeps its gathered input (no re-gather:
    theory's Dims.dtensor) and what its recomputation issues again; under mixed precision it sends
    some activations in fp32: there its [op, purpose] only."""
    mode = case.split("/")[0].split("+")[0]
    dtensor, mixed = mode.startswith("dtensor"), case.endswith("mixed")
    rows = theory.predict(run_config([*TINY, *CASES[case]])).comm_rows()
    return sorted([r.op, r.purpose] + ([] if dtensor and mixed else [r.bytes]) for r in rows)


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_issued_the_collectives_of_its_mode_and_switches(fake_cuda, case):
    """A step's collectives, counted as a memory run counts them, are the model's for the case's config:
    SP's gathers and scatters, VP's loss all-reduces, the re-gathers (none with sp_regather=false),
    the DP and gradient sums, in bytes (bf16, or fp32; autocast's bf16 under mixed precision)."""
    seen = fake_cuda["cases"][case]["comm"]
    predicted = predicted_comm(case)
    assert sorted([op, purpose, size][: len(predicted[0])] for op, purpose, _, size in seen) == predicted


@pytest.mark.parametrize("case", list(CASES))
def test_dropout_hashes_its_masks_on_cuda_where_it_is_on(fake_cuda, case):
    """The dropout masks are integer hashes (tpbench.models.dropout), on the device: no other op of a
    step is a bitwise xor."""
    assert (fake_cuda["cases"][case]["xors"] > 0) == ("dropout" in case)


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_on_cuda(fake_cuda, case):
    seen = fake_cuda["cases"].get(case)
    assert seen is not None, fake_cuda["errors"].get(case)
    assert seen["device"] == "cuda:0" and seen["loss"] == ["cuda"]
    assert seen["params"] == seen["grads"] == ["cuda"]
    assert seen["grads_missing"] == 0
    assert seen["optimizer_states"] == seen["params_count"]
    fused = "foreach_adamw" not in case  # train.fused_optimizer=auto: fused on CUDA
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
