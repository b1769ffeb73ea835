"""Warm workers (launch.reuse_workers, tpbench.run.batch): a sweep's runs in one torchrun job measure what
fresh jobs measure, to the byte (two validate runs beside one dense model, each alone when fresh), and a
run that fails in a batch fails as it would alone, the runs after
it running on. Real torchrun jobs (gloo on CPU, the tiny model)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import yaml
from beside import beside
from conftest import Workdir

# two modes, validate then memory: each memory run on workers that ran other runs before it (throughput
# stores timings, and its byte figures, the collectives, are validate's too: left out, four fresh jobs
# cost 40 s); the two validate runs next to each other, so that warm workers validate them beside one
# dense model (launch.share_dense)
SWEEP = [
    "kind=validate,memory",
    "mode=tp_sp,tp_vp",
    "validate.steps=2",
    "validate.every=1",
    "train.steps=2",
    "train.warmup=1",
]


def figures(work: Workdir) -> dict[tuple, tuple]:
    """What each run stored that does not depend on time, by run and row: every memory and validate
    figure but a time (validate_cpu_s) and how many runs shared a dense model (the storages freed late
    included: none, warm or fresh), every other figure in bytes, each collective's count and bytes, the
    gradient errors."""
    queries = {
        "measurements": "m.rank, m.name, m.step, m.value, m.unit FROM measurements m "
        "JOIN runs r ON r.id = m.run_id WHERE (r.kind != 'throughput' OR m.unit = 'B') AND m.unit != 's' "
        "AND m.name != 'validate_shared_by'",
        "comm": "c.rank, c.op, c.purpose, c.count, c.bytes FROM comm c JOIN runs r ON r.id = c.run_id",
        "param_errors": "p.rank, p.name, p.semantics, p.shape, p.grad_mean_abs, p.grad_max_abs, "
        "p.grad_rel_l2 FROM param_errors p JOIN runs r ON r.id = p.run_id",
    }
    keys = {"measurements": 3, "comm": 3, "param_errors": 2}  # the columns that name a row
    stored = {}
    for table, query in queries.items():
        for mode, kind, *row in work.query(f"SELECT r.mode, r.kind, {query}"):
            stored[(table, mode, kind, *row[: keys[table]])] = tuple(row[keys[table] :])
    return stored


def timeline(work: Workdir) -> list[tuple[str, str, str]]:
    return work.query("SELECT status, started_at, ended_at FROM runs ORDER BY id")


@beside
def warm_and_fresh(folder: Path) -> tuple[Workdir, Workdir]:
    """The same sweep on warm workers (one torchrun job) and in a fresh job per run."""
    warm, fresh = Workdir(folder / "warm"), Workdir(folder / "fresh")
    for work, reuse in ((warm, "true"), (fresh, "false")):
        work.path.mkdir()
        done = work.run("sweep", *SWEEP, f"launch.reuse_workers={reuse}")
        assert done.returncode == 0, done.stderr
    return warm, fresh


def test_warm_workers_measure_what_fresh_jobs_measure(warm_and_fresh):
    warm, fresh = warm_and_fresh
    # one job: each run starts as the one before it ends; fresh jobs start seconds later
    warm_runs, fresh_runs = timeline(warm), timeline(fresh)
    assert [status for status, _, _ in warm_runs] == ["OK"] * 4
    assert all(before[2] == after[1] for before, after in zip(warm_runs, warm_runs[1:], strict=False))
    assert not any(before[2] == after[1] for before, after in zip(fresh_runs, fresh_runs[1:], strict=False))
    # warm, the two validate runs stepped one dense model and its reference; fresh, each its own
    shared = "SELECT value FROM measurements WHERE name = 'validate_shared_by'"
    assert [v for (v,) in warm.query(shared)] == [2.0] * 4
    assert [v for (v,) in fresh.query(shared)] == [1.0] * 4
    # each memory run's every rank: no storage freed by gloo's thread outside a collective's wait
    late = "SELECT value FROM measurements WHERE name = 'memory_late_frees'"
    assert [v for (v,) in warm.query(late)] == [v for (v,) in fresh.query(late)] == [0.0] * 4
    warm_figures, fresh_figures = figures(warm), figures(fresh)
    assert len(warm_figures) > 100
    differ = {
        key: (value, fresh_figures.get(key))
        for key, value in warm_figures.items()
        if fresh_figures.get(key) != value
    }
    assert differ == {} and warm_figures.keys() == fresh_figures.keys()
    assert warm.live_workers() == [] and not list(warm.jobs.glob("tpbench-*"))  # no job folder left


@beside
def killed_in_a_batch(folder: Path) -> tuple[Workdir, str]:
    """Three validate runs in one batch; the test kills rank 1 of the second."""
    work = Workdir(folder)
    cli = work.start("sweep", "kind=validate", "validate.steps=2,100000,3", "validate.every=1")
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline and cli.poll() is None
        second = [job for job in work.jobs.glob("tpbench-job-*") if _runs_steps(job, 100000)]
        if second:
            break
        time.sleep(0.1)
    time.sleep(1)  # well into its steps
    os.kill(int((second[0] / "pids" / "rank1.pid").read_text()), signal.SIGKILL)
    _, stderr = cli.communicate(timeout=300)
    assert cli.returncode == 1, stderr
    return work, stderr


def test_a_run_killed_in_a_batch_is_that_runs_failure_and_the_rest_run(killed_in_a_batch):
    work, stderr = killed_in_a_batch
    rows = work.query(
        "SELECT json_extract(config, '$.validate.steps'), status, failed_rank, error, log_dir "
        "FROM runs ORDER BY id"
    )
    assert [row[:3] for row in rows] == [(2, "OK", None), (100000, "FAILED", 1), (3, "OK", None)]
    _, _, _, error, log_dir = rows[1]
    assert error.startswith("rank 1: ") and "Signal 9 (SIGKILL)" in error  # as kill_on_rank1 alone
    assert f"run 2 FAILED: {error} (logs: {log_dir})" in stderr
    # its logs are its own: rank 0's stdout and stderr of this run, beside the agent's log of the job
    logs = Path(log_dir) / "logs" / "batch" / "attempt_0"
    assert (Path(log_dir) / "launcher.log").exists() and (logs / "0" / "stderr.log").exists()
    assert yaml.safe_load((Path(log_dir) / "config.yaml").read_text())["validate"]["steps"] == 100000
    # the third ran in a job of its own, after the failure
    (_, _, first_end), (_, second_start, second_end), (_, third_start, _) = timeline(work)
    assert second_start == first_end and third_start != second_end
    assert work.live_workers() == [] and work.integrity() == "ok"


def _runs_steps(job: Path, steps: int) -> bool:
    """Whether `job` is a started run of `steps` validate steps. A finished OK run's folder is removed
    as the batch goes on, so it may vanish between the listing and the read."""
    try:
        started = (job / "pids" / "rank1.pid").exists()
        return started and yaml.safe_load((job / "config.yaml").read_text())["validate"]["steps"] == steps
    except FileNotFoundError:
        return False


def test_a_run_that_ends_a_group_beside_one_dense_model_fails_alone(tmp_path):
    """Two validate runs beside one dense model, the second raising: the job ends in the group, so
    both run again each alone (launch.share_dense=1), and each failure is its own run's."""
    work = Workdir(tmp_path)
    done = work.run(
        "sweep", "kind=validate", "validate.steps=2", "debug.validate_fault=rope_offset,raise_in_forward"
    )
    assert done.returncode == 1, done.stderr
    rows = work.query(
        "SELECT json_extract(config, '$.debug.validate_fault'), status, error, "
        "json_extract(config, '$.launch.share_dense') FROM runs ORDER BY id"
    )
    (first, status1, error1, shared1), (second, status2, error2, shared2) = rows
    assert (first, status1, shared1) == ("rope_offset", "FAILED", 1)
    assert error1.startswith("validate out of bounds: fwd_logits_max_abs")  # its own checks' failure
    assert (second, status2, shared2) == ("raise_in_forward", "FAILED", 1)
    assert "rank 1: RuntimeError: debug.validate_fault=raise_in_forward: rank 1 raised on purpose" in error2
    assert work.live_workers() == [] and work.integrity() == "ok"
