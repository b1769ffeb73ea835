"""`launcher=slurm` on a real one-node Slurm cluster (conftest.py `slurm`: munge, MariaDB, slurmdbd,
slurmctld and slurmd on this machine): a two-run sweep of two ranks each into the session's PostgreSQL
server (the jobs record their runs there, the password reaching them only through their environment),
whose submitting command is killed and followed again with --wait; and a job cancelled while it runs.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from conftest import FAST, PG_PASSWORD, Workdir

from tpbench.db import ResultsDB

SWEEP = ["sweep", *FAST, "mode=tp,tp_sp", "launcher=slurm", "launch.slurm.time_min=10"]


class SlurmWorkdir(Workdir):
    def __init__(self, path, cluster):
        super().__init__(path)
        self.cluster = cluster

    def env(self) -> dict[str, str]:
        return {**super().env(), "SLURM_CONF": str(self.cluster.conf)}

    def submitted(self) -> list[dict]:
        index = self.path / "runs" / "slurm" / "jobs.jsonl"
        return [json.loads(line) for line in index.read_text().splitlines()] if index.exists() else []


def _wait_for(condition, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def swept(slurm, postgres, tmp_path_factory):
    """The sweep is submitted, its command killed (the shell went away), then followed with --wait."""
    work = SlurmWorkdir(tmp_path_factory.mktemp("slurm"), slurm)
    url = postgres.new_database()
    sweep = [*SWEEP, f"db.url={url}"]
    first = work.start(*sweep)
    _wait_for(lambda: len(work.submitted()) == 2 or first.poll() is not None, "two submitted jobs")
    first.kill()
    first.communicate()
    followed = work.run(*sweep, "--wait", timeout=300)
    return work, url, sweep, followed


def test_a_sweep_runs_as_a_job_array_and_wait_follows_it_to_the_end(swept):
    work, url, _, followed = swept
    assert followed.returncode == 0, followed.stderr
    jobs = [entry["job_id"] for entry in work.submitted()]
    array = jobs[0].split("_")[0]
    assert jobs == [f"{array}_0", f"{array}_1"]  # one job array
    runs = ResultsDB(url, create=False).runs()
    rows = runs[["mode", "status", "slurm_job_id", "nodes", "world_size"]].values.tolist()
    host = socket.gethostname().split(".")[0]
    assert sorted(rows) == [["tp", "OK", jobs[0], host, 2], ["tp_sp", "OK", jobs[1], host, 2]]
    for job, run_id in runs[["slurm_job_id", "id"]].values.tolist():  # the follower said how each went
        assert f"{job} run {run_id} OK: " in followed.stderr
    assert work.live_workers() == []


def test_the_password_reaches_the_jobs_but_none_of_their_files(swept):
    work, _, _, _ = swept
    files = [p for p in (work.path / "runs" / "slurm").rglob("*") if p.is_file()]
    assert len(files) >= 8  # per job: the pickled submission and result, stdout and stderr
    assert not [p for p in files if PG_PASSWORD.encode() in p.read_bytes()]


def test_runs_shows_the_slurm_job_and_nodes(swept):
    work, url, _, _ = swept
    listed = work.invoke("runs", "--db", url)
    assert listed.exit_code == 0
    runs = ResultsDB(url, create=False).runs()
    for job, nodes in zip(runs["slurm_job_id"], runs["nodes"], strict=True):
        line = next(line for line in listed.stdout.splitlines() if f" {job} " in line)
        assert nodes in line


def test_wait_after_the_jobs_ended_says_how_each_went(swept):
    """--wait once every job has ended (the shell came back late): each job's run and how it went,
    not a silent "skipped" (the first follower above raced the jobs to it under load)."""
    work, url, sweep, _ = swept
    late = work.run(*sweep, "--wait", timeout=120)
    assert late.returncode == 0, late.stderr
    for job, run_id in ResultsDB(url, create=False).runs()[["slurm_job_id", "id"]].values.tolist():
        assert f"{job} run {run_id} OK: " in late.stderr
    assert len(work.submitted()) == 2


def test_the_same_sweep_again_submits_nothing(swept):
    work, url, sweep, _ = swept
    again = work.run(*sweep)
    assert again.returncode == 0, again.stderr
    assert "skipped" in again.stdout and len(work.submitted()) == 2
    assert len(ResultsDB(url, create=False).runs()) == 2


def test_a_cancelled_job_is_recorded_cancelled(slurm, tmp_path):
    work = SlurmWorkdir(tmp_path, slurm)
    cli = work.start(
        "run", "kind=validate", "validate.steps=1000000", "launcher=slurm", "launch.slurm.time_min=10"
    )
    _wait_for(lambda: len(work.live_workers()) == 2 or cli.poll() is not None, "running workers")
    (job,) = [entry["job_id"] for entry in work.submitted()]
    assert slurm.run("scancel", job).returncode == 0
    _, stderr = cli.communicate(timeout=120)
    assert cli.returncode == 1, stderr
    ((status, slurm_job, error, nodes),) = work.query("SELECT status, slurm_job_id, error, nodes FROM runs")
    assert (status, slurm_job) == ("CANCELLED", job) and error.startswith(f"Slurm ended job {job}: CANCELLED")
    assert nodes == socket.gethostname().split(".")[0]
    assert f"CANCELLED (Slurm job {job})" in stderr
    _wait_for(lambda: not work.live_workers(), "workers gone", timeout=30)


def test_two_array_tasks_sharing_a_first_node_rendezvous_at_different_ports(slurm, tmp_path, monkeypatch):
    """Two tasks of one job array on this node, each asked where tpbench's torchrun would rendezvous if
    the task spanned two nodes with this one first (as `SlurmRun` does in a multi-node job)."""
    import submitit

    from tpbench.run import slurm as tpslurm

    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    cfg = tpslurm._job_config(_run_config(["launch.launcher=slurm"]))

    def endpoint(task: int) -> str:
        class TwoNodes:  # the task's own Slurm environment, with a second node after this one
            def __getattr__(self, name):
                return getattr(submitit.JobEnvironment(), name)

            hostnames = [submitit.JobEnvironment().hostnames[0], "second-node"]

        return tpslurm._on_this_node(cfg, TwoNodes()).launch.rdzv_endpoint

    executor = submitit.SlurmExecutor(folder=tmp_path / "%j", max_num_timeout=0)
    executor.update_parameters(time=5, array_parallelism=2, cpus_per_task=1)
    jobs = executor.map_array(endpoint, [0, 1])
    endpoints = [job.result() for job in jobs]
    assert {job.job_id.split("_")[0] for job in jobs} == {jobs[0].job_id.split("_")[0]}  # one array
    host = socket.gethostname().split(".")[0]
    assert all(e.startswith(f"{host}:") for e in endpoints), endpoints
    assert endpoints[0] != endpoints[1], endpoints


def _run_config(overrides: list[str]):
    from torchrun_checks import run_config

    return run_config(overrides)


@pytest.mark.parametrize(
    ("state", "on_preempt", "ended", "status"),
    [
        ("TIMEOUT", "requeue", True, "TIMEOUT"),
        ("DEADLINE", "requeue", True, "TIMEOUT"),
        ("OUT_OF_MEMORY", "requeue", True, "OOM"),
        ("NODE_FAIL", "requeue", True, "NODE_FAIL"),
        ("CANCELLED", "requeue", True, "CANCELLED"),
        ("PREEMPTED", "requeue", False, None),  # requeued: Slurm runs it again, the follower waits
        ("PREEMPTED", "interrupted", True, "INTERRUPTED"),
        ("RUNNING", "interrupted", False, None),
        ("REQUEUED", "interrupted", False, None),
    ],
)
def test_each_slurm_ending_has_its_status(state, on_preempt, ended, status):
    """The endings the one-node test cluster cannot produce on demand (only a cancel is run above):
    which Slurm states end a run, and with which status, as `_record_ending` records them."""
    from torchrun_checks import run_config

    from tpbench.run import slurm

    cfg = run_config(["launch.launcher=slurm", f"launch.slurm.on_preempt={on_preempt}"])
    item = slurm.Followed(cfg, job_id="1", state=state)
    assert slurm._ended(item) is ended
    if ended:
        assert str(slurm.ENDINGS[state]) == status
