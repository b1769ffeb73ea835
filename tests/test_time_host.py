"""The time model's host term on a GPU (issue 60 item 1): the host issues every dispatched op and
collective at Rates.host_op_s (a sourced figure for a GPU not at hand, steptime.rates.HOST_OP_S; probed
on the GPU at hand); a step takes the longer of the device's time and the host's. On a CPU the per-op
cost is already on the compute's thread: no host term. All in-process, nothing runs a model."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from tpbench.predict import hardware
from tpbench.predict.steptime import cpu_rates, gpu_rates, model, predict_time
from tpbench.predict.steptime import ops as O
from tpbench.predict.steptime.rates import HOST_OP_S
from tpbench.predict.theory import comm_rows, dims
from tpbench.run import compose
from tpbench.sizing import fit as fitting

pytestmark = pytest.mark.not_quick
H100 = hardware.gpu("H100-SXM")
GPU_RUN = "launch.device=cuda launch.emulate=fake kind=memory train.compile=false dtype=bfloat16"


@functools.cache
def config(line: str):
    (cfg,) = compose.expand(line.split())
    return cfg


def dispatched(cfg) -> float:
    """The ops the step dispatches (each Op's kernels) and its collectives' calls."""
    d = dims(cfg)
    ops = sum(op.kernels for op in O.step_ops(d))
    return ops + sum(c.count for c in model.step_collectives(d, comm_rows(cfg)))


def test_the_host_issues_every_op_and_collective_at_its_cost_per_op():
    cfg = config(f"model=tiny tp=2 {GPU_RUN}")
    got = predict_time(cfg, gpu_rates(H100, "bfloat16"))
    assert got.host_s == pytest.approx(HOST_OP_S * dispatched(cfg))
    optimizer = sum(op.kernels for op in O.step_ops(dims(cfg)) if op.phase == O.STEP)
    assert got.host_optimizer_s == pytest.approx(HOST_OP_S * optimizer)
    probed = predict_time(cfg, gpu_rates(H100, "bfloat16", host_op_s=2 * HOST_OP_S))
    assert probed.host_s == pytest.approx(2 * got.host_s)


def test_a_tiny_step_is_host_bound_on_a_gpu_and_a_large_one_is_not():
    """The tiny model's kernels take less than their issue: the step is the host's time (seen failing
    without the host term: the step was the device's 3.9 ms against 6.1 ms of issue). An 8B model's
    step at S 8192 is the device's."""
    tiny = predict_time(config(f"model=tiny tp=2 {GPU_RUN}"), gpu_rates(H100, "bfloat16"))
    assert tiny.host_bound and tiny.step_s == tiny.host_s > tiny.device_s
    assert tiny.fields()["predicted_host_bound"] == 1.0
    large = predict_time(config(f"model=llama3_8b seq=8192 tp=1 {GPU_RUN}"), gpu_rates(H100, "bfloat16"))
    assert not large.host_bound and large.step_s == large.device_s > large.host_s > 0


def test_a_cpu_has_no_host_term():
    """On a CPU the per-op cost is in the compute (Rates.op_s on the compute's thread)."""
    cfg = config("model=tiny tp=2 kind=throughput train.compile=false")
    rates = replace(cpu_rates(cfg, 1), op_s=1e-5)
    got = predict_time(cfg, rates)
    assert got.host_s == 0.0 and got.step_s == got.device_s
    assert "predicted_host_s" not in got.fields()


def test_fit_marks_a_host_bound_row_and_times_it_by_the_host():
    """fit's rows take the host's time where it is longer (each micro-step's ops, the optimizer's
    once) and say so; a large model's rows are the device's."""
    request = fitting.parse("model=qwen3_0_6b seq=128 gpu=H100 tp=1 micro_batch=1 recompute=none".split())
    (base,) = compose.expand(request.overrides, single=True, launching=False)
    fit = fitting.solve(request, base)
    row = fit.rows[0]
    timed = predict_time(fit.config(row), gpu_rates(H100, "bfloat16"))
    assert row.host_bound and timed.host_bound
    assert row.step_s == pytest.approx(
        row.accumulation * (timed.host_s - timed.host_optimizer_s) + timed.host_optimizer_s
    )
    big = fitting.parse("model=llama3_8b seq=8192 gpu=H100 tp=1 dp_shard=full micro_batch=2".split())
    (base,) = compose.expand(big.overrides, single=True, launching=False)
    assert not any(r.host_bound for r in fitting.solve(big, base).rows if not r.reason)
