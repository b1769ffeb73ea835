"""The environment a run's workers set before CUDA starts (tpbench.run.worker.worker_env): an overlap run on
a real GPU gets CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron sets it, and records it with its results."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torchrun_checks import run_config

from tpbench.results import RankResult
from tpbench.run import worker


def cfg_of(device: str, overlap: bool, emulate: str = "none"):
    cfg = run_config(
        [f"parallel.overlap={str(overlap).lower()}", "parallel.tp=2", f"launch.emulate={emulate}"]
    )
    cfg.launch.device = device
    return cfg


@pytest.mark.parametrize(
    ("device", "overlap", "emulate", "env"),
    [
        ("cuda", True, "none", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
        ("cuda", False, "none", {}),  # nothing to hide a collective behind: the GPU's queues as they are
        ("cpu", True, "none", {}),
        ("cuda", True, "fake", {}),  # an emulated GPU starts no CUDA
    ],
)
def test_an_overlap_run_on_cuda_gets_one_hardware_queue(device, overlap, emulate, env):
    assert worker.worker_env(cfg_of(device, overlap, emulate)) == env


_run = worker._run  # the real one, before a test patches it


def test_the_worker_sets_it_before_cuda_starts(monkeypatch, tmp_path):
    """main() sets the variable before choosing its device, where CUDA starts."""
    monkeypatch.delenv(worker.MAX_CONNECTIONS, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg, seen = cfg_of("cuda", True), {}

    def device(cfg, local_rank):
        seen["at_device"] = os.environ.get(worker.MAX_CONNECTIONS)
        return torch.device("cuda", 0)

    monkeypatch.setattr(worker, "load_run_config", lambda path: cfg)
    monkeypatch.setattr(worker, "_register", lambda job_dir, rank: None)
    monkeypatch.setattr(worker.signal, "alarm", lambda seconds: None)
    monkeypatch.setattr(worker, "_device", device)
    monkeypatch.setattr(worker.machine, "write_rank_device", lambda *args: None)
    monkeypatch.setattr(worker.machine, "rank_device_name", lambda *args: "")
    monkeypatch.setattr(worker, "_init_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(worker, "_cap_memory", lambda *args: None)
    monkeypatch.setattr(worker, "_run", lambda *args, **kwargs: None)
    worker.main(tmp_path)
    assert seen == {"at_device": "1"}


@pytest.mark.parametrize(("env", "recorded"), [("1", 1.0), (None, None)])
def test_a_cuda_run_records_the_value_it_ran_under(monkeypatch, tmp_path, env, recorded):
    if env is None:
        monkeypatch.delenv(worker.MAX_CONNECTIONS, raising=False)
    else:
        monkeypatch.setenv(worker.MAX_CONNECTIONS, env)
    monkeypatch.setattr(worker, "experiment", lambda kind: lambda cfg: RankResult(rank=0))
    monkeypatch.setattr(worker.faults, "before_experiment", lambda *args: None)
    monkeypatch.setattr(worker.emulation, "emulated", lambda cfg: True)  # saved to the folder: no group
    monkeypatch.setattr(worker.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(worker.gc, "freeze", lambda: None)
    _run(cfg_of("cuda", True), tmp_path, 0, torch.device("cuda", 0))
    saved = RankResult.load(Path(tmp_path) / "results" / "rank0.json")
    assert {m.name: m.value for m in saved.measurements}.get("cuda_device_max_connections") == recorded


# -- glibc keeps what a CPU step frees (machine.keep_freed_memory) -----------------------------------


def test_the_worker_keeps_freed_memory_on_a_cpu(monkeypatch):
    called = []
    monkeypatch.setattr(worker.machine, "keep_freed_memory", lambda: called.append(True) or True)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert worker._device(cfg_of("cpu", False), 0) == torch.device("cpu")
    assert called == [True]
