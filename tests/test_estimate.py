"""Estimates before a run and progress during it (tpbench.sizing.estimate, tpbench.predict.rate_probe,
tpbench.cli.progress, tpbench.experiments.progress): the rate is measured once and cached, never
trusted when corrupt or foreign; the estimate follows the FLOPs a run executes; a dtype with no fast
kernel here gets its line; a real `tpbench run` shows its steps on stderr, and nothing of it under
--json."""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import pytest
from beside import beside
from conftest import Workdir

from tpbench.cli import progress
from tpbench.predict import rate_probe, steptime, theory
from tpbench.run import compose
from tpbench.run.sweep import Ran
from tpbench.sizing import estimate


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty rate cache of its own; returns its file."""
    monkeypatch.setenv("TPBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(progress.os, "getloadavg", lambda: (0.5, 0.5, 0.5))  # an idle machine
    return rate_probe.cache_file()


@functools.cache
def config(line: str):
    """One run's config (composing costs ~0.3 s: each line once): kind=memory unless it says another."""
    (cfg,) = compose.expand([*(["kind=memory"] if "kind=" not in line else []), *line.split()])
    return cfg


def vary(cfg, section: str, **fields):
    """`cfg` with fields of one section changed, without composing again."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)})


# the time model's other rates on this machine (tpbench.predict.rate_probe.time_rates), round figures
TIME_RATES = {"gemm_small": 5e9, "attention": 5e9, "bandwidth": 1e10, "op_s": 1e-5}
GLOO = {
    f"{x}_{k}": v
    for k in ("all_reduce", "all_gather", "reduce_scatter")
    for x, v in (("alpha", 1e-4), ("beta", 1e-9))
}


def write_rates(path, cfg, rates: dict[str, float]) -> None:
    """The cache as a measurement of these rates on this machine would have left it: the matmul's
    per dtype, the time model's for groups of 1 and 2."""
    entries = [{**rate_probe._key(dtype, cfg, 1), "flops_per_s": r} for dtype, r in rates.items()]
    for group in (1, 2):
        key = {**rate_probe._key("float32", cfg, 1), "probe": rate_probe.TIME_PROBE, "group": group}
        entries.append({**key, "rates": {**TIME_RATES, **(GLOO if group > 1 else {})}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rates": entries}))


def no_probe(*args):
    raise AssertionError("measured again: the cached rate was not used")


# -- the rate -------------------------------------------------------------------------------------


def test_the_rate_is_measured_once_then_read_from_the_cache(cache, monkeypatch):
    cfg = config("kind=memory")
    start = time.process_time()  # the budget is CPU time: other processes do not count
    measured = rate_probe.rate("float32", cfg, 1)
    assert time.process_time() - start < 2 * rate_probe.PROBE_BUDGET_S
    (entry,) = json.loads(cache.read_text())["rates"]
    assert entry["flops_per_s"] == measured > 1e8
    assert (entry["dtype"], entry["threads"], entry["device"]) == ("float32", 1, "cpu")
    monkeypatch.setattr(rate_probe, "probe", no_probe)
    assert rate_probe.rate("float32", cfg, 1) == measured


@pytest.mark.parametrize("rate", [2e11, 6e9])  # the 2048 reached (STEADY_S), or the budget stops at 512
def test_the_matmul_probe_is_the_median_of_its_last_timed_sizes_calls(monkeypatch, rate):
    """Each size timed warm, then the last size timed again within the budget: FLOP/s of that size,
    whichever way the sizes stopped. At 6e9 FLOP/s a 512 takes 45 ms and two calls of 1024 would
    overrun the budget: the probe stops at 512 (a probe once divided 1024's FLOPs by 512's time: fp64
    read 711 GFLOP/s on a CPU of 94)."""
    calls = []

    def matmul_seconds(a, b, threads):
        calls.append(a.shape[0])
        return 2.0 * a.shape[0] ** 3 / rate * (1.0 + 0.1 * (len(calls) % 2))  # two speeds, alternating

    monkeypatch.setattr(rate_probe, "_matmul_seconds", matmul_seconds)
    monkeypatch.setattr(
        rate_probe.torch, "randn", lambda *shape, **kw: rate_probe.torch.zeros(1).expand(*shape)
    )
    measured = rate_probe.probe(rate_probe.torch.float64, rate_probe.torch.device("cpu"), 1)
    last = 2048 if rate > 1e10 else 512
    assert max(calls) == last and calls.count(last) == 2 + 2  # warm, timed, and two more in the budget
    assert measured == pytest.approx(rate)  # the median of the three timed: the faster speed twice


def test_fp32_accumulates_cost_per_op_is_probed_once_then_read_from_the_cache(cache, monkeypatch):
    """What launch.bf16_gemm=fp32_accumulate's dispatch mode adds to each op: the tiny step with and
    without it, per op (Python's __torch_dispatch__ on every aten op: microseconds, not nothing)."""
    cfg = config("kind=validate dtype=bfloat16 launch.bf16_gemm=fp32_accumulate")
    op_s = rate_probe.fp32_accumulate_op_s(cfg, 1)
    assert 1e-8 < op_s < 1e-3
    (entry,) = json.loads(cache.read_text())["rates"]
    assert (entry["op_s"], entry["probe"]) == (op_s, rate_probe.ACCUMULATE_PROBE)
    monkeypatch.setattr(rate_probe, "_tiny_step", no_probe)
    assert rate_probe.fp32_accumulate_op_s(cfg, 1) == op_s


def test_rates_probed_on_a_busy_machine_are_probed_again_once_it_is_idle(cache, monkeypatch):
    """The collectives are timed on the wall clock: an entry records the load it was probed at, and
    one probed above the cores is measured again when the load is not (kept while it still is)."""
    cfg = config("kind=memory")
    write_rates(cache, cfg, {"float32": 1e10})
    stored = json.loads(cache.read_text())
    for entry in stored["rates"]:
        entry["load"] = 7.5 if entry.get("group") == 2 else 0.3
    cache.write_text(json.dumps(stored))
    monkeypatch.setattr(rate_probe.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(rate_probe.os, "getloadavg", lambda: (6.0, 6.0, 6.0))  # still busy
    monkeypatch.setattr(rate_probe, "probe_time_rates", no_probe)
    assert rate_probe.time_rates(cfg, 1, 2) == {**TIME_RATES, **GLOO}
    monkeypatch.setattr(rate_probe.os, "getloadavg", lambda: (0.4, 0.4, 0.4))  # idle
    assert rate_probe.time_rates(cfg, 1, 1) == TIME_RATES  # probed idle: kept
    fresh = {"gemm_small": 1.0, "attention": 1.0, "bandwidth": 1.0, "op_s": 1.0}
    monkeypatch.setattr(rate_probe, "probe_time_rates", lambda threads: dict(fresh))
    monkeypatch.setattr(rate_probe, "probe_collectives", lambda group: {"alpha_all_reduce": 2.0})
    assert rate_probe.time_rates(cfg, 1, 2) == {**fresh, "alpha_all_reduce": 2.0}
    (entry,) = [e for e in json.loads(cache.read_text())["rates"] if e.get("group") == 2]
    assert entry["load"] == 0.4


def test_a_group_larger_than_the_cores_and_8_takes_8s_probe_scaled_by_the_rings_steps(cache, monkeypatch):
    """32 forked ranks on 2 cores cost 35 s to probe: a group past max(cores, 8) is probed at that
    size, once, and its alphas scaled by the ring's steps, (32 - 1) / (8 - 1); its betas (per ring
    byte) are the probed group's. Up to it, a group is probed as itself."""
    cfg = config("kind=memory")
    monkeypatch.setattr(rate_probe.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(rate_probe.os, "getloadavg", lambda: (0.4, 0.4, 0.4))
    assert [rate_probe.probed_group(g) for g in (1, 2, 8, 16, 32)] == [1, 2, 8, 8, 8]
    monkeypatch.setattr(rate_probe.os, "cpu_count", lambda: 64)  # ranks that each have a core
    assert rate_probe.probed_group(32) == 32
    monkeypatch.setattr(rate_probe.os, "cpu_count", lambda: 2)
    probed = []
    monkeypatch.setattr(rate_probe, "probe_time_rates", lambda threads: dict(TIME_RATES))
    monkeypatch.setattr(rate_probe, "probe_collectives", lambda group: probed.append(group) or dict(GLOO))
    at32 = rate_probe.time_rates(cfg, 1, 32)
    assert probed == [8]
    for k, v in GLOO.items():
        assert at32[k] == pytest.approx(v * 31 / 7 if k.startswith("alpha") else v)
    assert rate_probe.time_rates(cfg, 1, 16)["alpha_all_gather"] == pytest.approx(1e-4 * 15 / 7)
    assert rate_probe.time_rates(cfg, 1, 8) == {**TIME_RATES, **GLOO} and probed == [8]  # cached
    assert (
        "gloo over 8, its alphas scaled to 32 by the ring's steps"
        in steptime.cpu_rates(config("kind=memory parallel.dp=32"), 1).source
    )


@pytest.mark.parametrize(
    "stored",
    [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"rates": "fast"}),
        {"flops_per_s": -1.0},
        {"flops_per_s": "1e12"},
        {"flops_per_s": True},
        {"flops_per_s": float("inf")},
        {"torch": "1.0.0"},  # another torch
        {"device_name": "AMD EPYC 9B14"},  # another CPU (a home folder shared between machines)
        {"threads": 2},
        {"probe": "matmul, wall clock"},  # measured as an older tpbench did
    ],
)
def test_a_corrupt_or_foreign_entry_is_measured_again(cache, monkeypatch, stored):
    cfg = config("kind=memory")
    cache.parent.mkdir(parents=True)
    if isinstance(stored, dict):  # an entry of this machine but for the changed field(s)
        entry = {**rate_probe._key("float32", cfg, 1), "flops_per_s": 5e12, **stored}
        cache.write_text(json.dumps({"rates": [entry]}))
    else:
        cache.write_text(stored)
    monkeypatch.setattr(rate_probe, "probe", lambda *args: 3e10)
    assert rate_probe.rate("float32", cfg, 1) == 3e10
    rates = json.loads(cache.read_text())["rates"]
    assert {e["flops_per_s"] for e in rates if e.get("torch") == rate_probe.torch.__version__} >= {3e10}
    monkeypatch.setattr(rate_probe, "probe", no_probe)  # and the new figure is read back
    assert rate_probe.rate("float32", cfg, 1) == 3e10


def test_the_threads_are_those_a_worker_of_the_run_gets(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(estimate.os, "cpu_count", lambda: 16)
    four_ranks = vary(config("kind=memory"), "parallel", dp=2)
    assert estimate.worker_threads(four_ranks) == 4
    assert estimate.worker_threads(vary(four_ranks, "launch", emulate="real")) == 16  # one process
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert estimate.worker_threads(four_ranks) == 3


# -- the estimate ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    ["mode=ddp tp=1 dp=1", "model=seed_memory layers=2 tp=1", "model=minimind2_small seq=64 tp=1 vp=true"],
)
def test_one_rank_alone_executes_the_model_flops(line):
    assert estimate.rank_step_flops(config(line)) == pytest.approx(theory.model_flops_per_step(config(line)))


def test_a_rank_executes_its_share_of_the_step():
    whole = estimate.rank_step_flops(config("model=seed_memory tp=1"))
    tp2, vp = (estimate.rank_step_flops(config(f"model=seed_memory tp=2 {x}")) for x in ("", "vp=true"))
    assert vp == pytest.approx(whole / 2) and vp < tp2 < whole  # without VP the LM head is replicated
    ddp = config("model=seed_memory mode=ddp dp=2")  # each rank its micro-batch of the global batch
    assert estimate.rank_step_flops(ddp) == pytest.approx(theory.model_flops_per_step(ddp) / 2)


def test_the_estimate_is_the_time_models_step_times_the_steps_run(cache, monkeypatch):
    def compute_s(cfg, section: str = "train", **fields) -> float:
        return estimate.estimate(vary(cfg, section, **fields)).compute_s

    write_rates(cache, config("kind=memory"), {"float32": 1e10, "bfloat16": 1e9})
    monkeypatch.setattr(rate_probe, "probe_time_rates", no_probe)  # the cached rates only
    # throughput's FLOP-counted step (its collectives are timed in the timed steps; dtensor: + a counted one)
    for kind, extra in (("memory", 0), ("throughput", 1)):
        cfg = vary(config(f"kind={kind}"), "train", warmup=1)
        assert compute_s(cfg, steps=11) == pytest.approx(compute_s(cfg, steps=5) * (12 + extra) / (6 + extra))
    one_rank = config("tp=1 kind=throughput")
    for layers in (2, 8):
        cfg = vary(one_rank, "model", num_hidden_layers=layers)
        rates = steptime.rates_for(cfg, threads=1)
        step = steptime.predict_time(cfg, rates).step_s
        assert compute_s(cfg) == pytest.approx(step * (cfg.train.warmup + 1 + cfg.train.steps))
    cfg = config("kind=memory")
    assert 1 < compute_s(cfg, dtype="bfloat16") / compute_s(cfg) < 10  # the GEMMs' share, 10x slower
    assert "STEP_OVERHEAD" not in dir(estimate)  # no factor fitted to step times
    fake = vary(cfg, "launch", emulate="fake")
    assert estimate.estimate(fake).flops == {} and estimate.estimate(fake).seconds == estimate.LAUNCH_S


def test_validate_counts_the_dense_model_the_shard_and_the_reference(cache):
    cfg = vary(config("kind=validate"), "validate", steps=9, every=3)
    dense, share = theory.model_flops_per_step(cfg), estimate.rank_step_flops(cfg)
    assert share < dense  # tp=2
    # 1 + 9 steps of both models, and 3 comparisons (steps 3, 6, 9): a forward of each; the fp64
    # reference's 1 + 9 steps
    assert estimate.executed_flops(cfg) == {
        "float32": pytest.approx((dense + share) * (10 + 3 / 3)),
        "float64": pytest.approx(dense * 10),
    }
    bf16 = estimate.executed_flops(vary(cfg, "train", dtype="bfloat16"))
    assert bf16["float32"] == pytest.approx(dense * 10) and bf16["bfloat16"] > 0
    # beside the run before it (launch.share_dense), its own model only
    assert estimate.executed_flops(cfg, beside=True) == {"float32": pytest.approx(share * (10 + 3 / 3))}


def test_the_fp64_reference_is_the_fp32_step_at_the_fp64_matmul_rate(cache):
    cfg = vary(config("kind=validate"), "validate", steps=9, every=3)
    write_rates(cache, cfg, {"float32": 80e9, "float64": 20e9})
    e = estimate.estimate(cfg)
    assert e.steps["fp64 reference"] == 10 and e.step_s["fp64 reference"] == pytest.approx(
        4 * e.step_s["dense"]
    )
    alone, beside = e.compute_s, estimate.estimate(cfg, beside=True).compute_s
    assert beside == pytest.approx(e.steps["step"] * e.step_s["step"]) and beside < alone / 2


# -- what the command line says before it launches -------------------------------------------------

SEED_BF16 = "kind=memory mode=ddp model=seed_memory seq=512 layers=8 dtype=bfloat16"


def test_a_dtype_with_no_fast_kernel_gets_a_line_with_the_figures_and_what_to_do(cache, capsys):
    write_rates(cache, config("kind=memory"), {"float32": 82e9, "bfloat16": 0.4e9})
    seconds = progress.say_estimates([config(SEED_BF16)], sweep=False)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("estimate: memory ddp tp=1 dp=2 layers=8 bfloat16: ~5.5 h (")
    assert seconds[0] > 3600 and lines[1].startswith("long run: memory ddp tp=1 dp=2 layers=8 bfloat16")
    (slow,) = [line for line in lines if "no fast matmul kernel" in line]
    assert slow.startswith("bfloat16 has no fast matmul kernel here: 0.4 GFLOP/s against float32's 82 (")
    assert "dtype=float32 (the same run's matmuls 205x faster)" in slow and "launch.emulate=fake" in slow
    if "avx512_bf16" not in rate_probe._cpu_flags():
        assert "/proc/cpuinfo has no avx512_bf16" in slow


@pytest.mark.parametrize(
    "rates", [{"float32": 82e9, "bfloat16": 160e9}, {"float32": 82e9, "bfloat16": 0.4e9}]
)
def test_no_slow_kernel_line_for_fp32_nor_a_fast_dtype(cache, capsys, rates):
    write_rates(cache, config("kind=memory"), rates)
    fast_bf16 = rates["bfloat16"] > rates["float32"]
    progress.say_estimates([config(SEED_BF16 if fast_bf16 else "kind=memory")], sweep=False)
    said = capsys.readouterr().err
    assert "no fast matmul kernel" not in said and "estimate: memory" in said
    assert fast_bf16 or "long run" not in said  # the tiny fp32 run is seconds


def test_a_sweep_says_its_total_and_its_longest_run(cache, capsys):
    write_rates(cache, config("kind=memory"), {"float32": 1e10})
    configs = [vary(config("kind=memory"), "model", num_hidden_layers=L) for L in (2, 8)]
    configs = [vary(c, "launch", reuse_workers=False) for c in configs]  # a launch each
    seconds = progress.say_estimates(configs, sweep=True)
    (line,) = capsys.readouterr().err.splitlines()
    total = estimate.duration(sum(seconds))
    longest = "memory tp tp=2 dp=1 layers=8 float32"
    assert line == f"estimate: 2 runs, ~{total} in all; the longest ~{seconds[1]:.0f} s ({longest})"


def test_runs_on_warm_workers_pay_one_launch(cache, capsys):
    """Consecutive runs that share a torchrun job (tpbench.run.batch) pay its launch once; a run that runs
    alone (launch.reuse_workers=false) pays its own."""
    write_rates(cache, config("kind=memory"), {"float32": 1e10})
    first, second = (vary(config("kind=memory"), "model", num_hidden_layers=L) for L in (2, 3))
    alone = vary(second, "launch", reuse_workers=False)
    warm = progress.say_estimates([first, second], sweep=False)
    cold = progress.say_estimates([first, alone], sweep=False)
    lines = capsys.readouterr().err.splitlines()
    compute = estimate.estimate(second).compute_s
    assert warm[1] == pytest.approx(estimate.WARM_RUN_S + compute)
    assert cold[1] == pytest.approx(estimate.LAUNCH_S + compute) and warm[0] == cold[0]
    assert lines[1].endswith("on the run before's workers)") and lines[3].endswith("s to launch)")


def test_runs_validated_beside_one_dense_side_take_the_first_runs_time(cache, capsys):
    """A share_dense group is stepped in one process (tpbench.experiments.validate.run_beside): the
    first run's time holds the dense side and every run's own model; the others end with it."""
    base = vary(config("kind=validate"), "validate", steps=9, every=3)
    write_rates(cache, base, {"float32": 1e10, "float64": 1e9})
    modes = [vary(base, "parallel", sp=sp, vp=vp) for sp, vp in ((False, False), (True, False), (True, True))]
    seconds = progress.say_estimates(modes, sweep=False)
    lines = capsys.readouterr().err.splitlines()
    alone = [estimate.estimate(c) for c in modes]
    own = [estimate.estimate(c, beside=True).compute_s for c in modes]
    assert seconds[0] == pytest.approx(alone[0].seconds + own[1] + own[2]) and seconds[1:] == [0.0, 0.0]
    assert f"{own[1] + own[2]:.3g} s (2 runs beside it)" in lines[0]
    assert "~0 s (validated beside the run before, in its time" in lines[1]
    one = [vary(c, "launch", share_dense=1) for c in modes]  # each alone: its own dense side
    assert progress.say_estimates(one, sweep=False)[1] > estimate.WARM_RUN_S + alone[1].compute_s / 2


def test_a_busy_machine_is_said_to_make_runs_longer(cache, capsys, monkeypatch):
    write_rates(cache, config("kind=memory"), {"float32": 1e10})
    monkeypatch.setattr(progress.os, "getloadavg", lambda: (26.4, 20.0, 10.0))
    monkeypatch.setattr(progress.os, "cpu_count", lambda: 2)
    progress.say_estimates([config("kind=memory")], sweep=False)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "this machine's load is 26.4 on 2 cores: the runs will take longer than estimated (the "
        "estimates are for a machine the run has to itself)"
    )


# -- progress --------------------------------------------------------------------------------------


def test_plain_progress_is_a_line_every_few_seconds_and_one_per_run_end(capsys):
    configs = [vary(config("kind=memory"), "model", num_hidden_layers=L) for L in (1, 2)]
    now = [100.0]
    runs = progress.RunsProgress([10.0, 30.0], quiet=False, sweep=True, skipped=1, clock=lambda: now[0])
    with runs:
        say = runs.on_start(configs[0])
        say("memory step 1/7 · 0.1 s elapsed · ~0.6 s left")
        now[0] += 4
        say("memory step 2/7 · 0.2 s elapsed · ~0.5 s left")  # within PLAIN_EVERY_S: not said
        now[0] += progress.PLAIN_EVERY_S
        say("memory step 7/7 · 0.7 s elapsed · ~0.0 s left")  # 14 s into a run estimated at 10 s
        now[0] += progress.PLAIN_EVERY_S
        say("memory step 7/7 · 0.7 s elapsed · ~0.0 s left")  # the same line: not again so soon
        now[0] -= progress.PLAIN_EVERY_S
        now[0] += 6
        runs.ended(Ran(1, configs[0], "OK"))  # the first run took 20 s: twice its estimate
        runs.on_start(configs[1])
        assert runs.remaining() == 2 * 30.0  # its estimate, scaled
        now[0] += 45  # past its estimate, not past the scaled one
        assert runs.remaining() == 2 * 30.0 - 45
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[0/2 runs · ok 0 · failed 0 · skipped 1 · ~0:40 left] memory tp tp=2 dp=1 layers=1: "
        "memory step 1/7 · 0.1 s elapsed · ~0.6 s left",
        "[0/2 runs · ok 0 · failed 0 · skipped 1 · ~0:30 left] memory tp tp=2 dp=1 layers=1: "
        "memory step 7/7 · 0.7 s elapsed · ~0.0 s left",
        "memory tp tp=2 dp=1 layers=1: OK in 20.0 s (estimated ~10 s)",
        "sweep: 1/2 runs · ok 1 · failed 0 · skipped 1 · 1:05 elapsed",
    ]


def test_quiet_progress_says_nothing(capsys):
    cfg = config("kind=memory")
    with progress.RunsProgress([], quiet=True, sweep=True) as runs:
        runs.on_start(cfg)("memory step 1/7 · 0.1 s elapsed · ~0.6 s left")
        runs.ended(Ran(1, cfg, "OK"))
    assert capsys.readouterr().err == ""


@beside
def ran_with_progress(folder):
    """A real `tpbench run` whose steps last a few seconds, stderr not a terminal. (Under --json, stderr
    has none of it: tests/test_runner.py's default run checks that on its own launch.)"""
    return Workdir(folder).run("run", "kind=validate", "validate.steps=100", "validate.every=100")


def test_a_real_run_says_its_estimate_and_its_steps_on_stderr(ran_with_progress):
    done = ran_with_progress
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("estimate: validate tp tp=2 dp=1 layers=2 float32: ~")
    steps = [line for line in lines if line.startswith("validate tp tp=2 dp=1 layers=2: validate step ")]
    assert steps and all(" s elapsed · ~" in line and line.endswith(" s left") for line in steps)
    assert "validate step" not in done.stdout
