"""The runner end to end: real torchrun jobs (gloo on CPU, the tiny model), real SQLite files.

Launches are the cost here, so one command checks many things: one sweep fills the database that most
tests read, and one sweep injects every fault. The fault sweeps run beside the other tests (tests/beside.py):
their hangs wait out a timeout.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from beside import beside
from conftest import FAST, Workdir

from tpbench.db import ResultsDB

# A config string and a sweep name with quotes, spaces, `;` and `$`: stored and shown verbatim.
ODD_NAME = """it's a "tiny"; echo $HOME && rm -rf nothing"""
ODD_NAME_OVERRIDE = """model.name='it\\'s a "tiny"; echo $HOME && rm -rf nothing'"""
ODD_SWEEP = """nightly [bold]'a'[/bold]; "b" $(x)"""
VALIDATE_METRICS = {
    "fwd_logits_max_abs",
    "loss_abs_diff",
    "grad_max_abs",
    "grad_max_rel_l2",
    "adamw_param_max_abs",
    "passed",
    "comm_bytes_per_step",
}


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Workdir, object, list[dict]]:
    """A sweep of two configs into a fresh database, printed as JSON."""
    work = Workdir(tmp_path_factory.mktemp("swept"))
    done = work.run("sweep", *FAST, "mode=tp,tp_sp", ODD_NAME_OVERRIDE, "--name", ODD_SWEEP, "--json")
    return work, done, [json.loads(line) for line in done.stdout.splitlines()]


def test_sweep_records_every_run(swept):
    work, done, printed = swept
    assert done.returncode == 0, done.stderr
    assert "estimate" not in done.stderr and "sweep:" not in done.stderr  # --json: no progress
    rows = work.query(
        "SELECT id, status, mode, tp, dp, sp, vp, layers, hidden, seq, world_size, backend, device, "
        "kind, batch_policy, error, failed_rank, sweep FROM runs ORDER BY id"
    )
    assert [r[1:] for r in rows] == [
        (
            "OK",
            "tp",
            2,
            1,
            0,
            0,
            2,
            64,
            32,
            2,
            "gloo",
            "cpu",
            "validate",
            "fixed_per_rank",
            "",
            None,
            ODD_SWEEP,
        ),
        (
            "OK",
            "tp_sp",
            2,
            1,
            1,
            0,
            2,
            64,
            32,
            2,
            "gloo",
            "cpu",
            "validate",
            "fixed_per_rank",
            "",
            None,
            ODD_SWEEP,
        ),
    ]
    for run_id, *_ in rows:
        names = work.query("SELECT DISTINCT name FROM measurements WHERE run_id = ? AND step IS NULL", run_id)
        assert VALIDATE_METRICS <= {n for (n,) in names}
        ranks = work.query("SELECT DISTINCT rank FROM measurements WHERE run_id = ?", run_id)
        assert sorted(r for (r,) in ranks) == [0, 1]
        assert work.query("SELECT count(*) FROM param_errors WHERE run_id = ?", run_id)[0][0] > 0
        assert work.query("SELECT count(*) FROM comm WHERE run_id = ?", run_id)[0][0] > 0
    assert work.integrity() == "ok"
    assert work.live_workers() == []


def test_json_is_one_object_per_run_with_the_resolved_config(swept):
    work, _, printed = swept
    assert [p["id"] for p in printed] == [1, 2]
    for record in printed:
        assert record["status"] == "OK" and record["error"] == ""
        assert record["config"]["model"]["name"] == ODD_NAME
        assert (
            record["config"]["launch"]["device"] == "cpu" and record["config"]["launch"]["backend"] == "gloo"
        )
        assert VALIDATE_METRICS <= set(record["metrics"]) and record["metrics"]["passed"] == 1.0
    shown = work.invoke("runs", "show", "2", "--json")
    assert json.loads(shown.stdout) == printed[1]


def test_strings_are_stored_and_shown_verbatim(swept):
    work, _, _ = swept
    (config,) = work.query("SELECT config FROM runs WHERE id = 1")[0]
    assert json.loads(config)["model"]["name"] == ODD_NAME
    shown = work.invoke("runs", "show", "1")
    assert shown.exit_code == 0 and ODD_SWEEP in shown.stdout


def test_a_second_sweep_skips_what_is_done(swept):
    work, _, _ = swept
    jobs_before = set(work.jobs.iterdir())
    again = work.invoke("sweep", *FAST, "mode=tp,tp_sp", ODD_NAME_OVERRIDE)
    assert again.exit_code == 0, again.stderr
    assert "skipped 2" in again.stderr
    assert work.query("SELECT count(*) FROM runs")[0][0] == 2
    assert set(work.jobs.iterdir()) == jobs_before  # nothing launched


def test_force_runs_a_finished_config_again(swept):
    work, _, _ = swept
    forced = work.run("sweep", *FAST, "mode=tp", ODD_NAME_OVERRIDE, "--force")
    assert forced.returncode == 0, forced.stderr
    assert work.query("SELECT id, mode, status FROM runs WHERE id > 2") == [(3, "tp", "OK")]


def test_python_api_returns_frames(swept):
    work, _, _ = swept
    db = ResultsDB(f"sqlite:///{work.db}", create=False)
    runs = db.runs(status="OK", mode="tp_sp")
    assert runs["id"].tolist() == [2]
    metrics = db.metrics([1, 2])
    assert list(metrics.index) == [1, 2] and VALIDATE_METRICS <= set(metrics.columns)
    long = db.measurements([1])
    per_run = long[long["step"].isna()]
    assert metrics.at[1, "grad_max_abs"] == per_run[per_run["name"] == "grad_max_abs"]["value"].max()
    assert not long[long["name"] == "adamw_logits_max_abs"]["step"].isna().any()  # the curve keeps its steps


def test_runs_lists_with_filters(swept):
    work, _, _ = swept
    listed = work.invoke("runs", "--mode", "tp_sp")
    assert listed.exit_code == 0
    assert "1 run in" in listed.stdout and "tp_sp" in listed.stdout and "passed" in listed.stdout
    assert "0 runs" in work.invoke("runs", "--status", "FAILED", "--since", "1d").stdout


# -- faults -----------------------------------------------------------------------------------------

FAULTS = "raise_on_rank1,kill_on_rank1,hang_on_rank1,oom_on_rank1,print_flood,big_result"
# Every run of the fault sweeps gets it: a hang waits it out (beside other tests). It bounds every other
# collective of those runs too, so it leaves room for one rank to reach init_process_group, or big_result's
# gather, seconds after the other on a loaded machine.
COLLECTIVE_TIMEOUT_S = 8


@beside(waits=True)
def faulted(folder: Path) -> tuple[Workdir, subprocess.CompletedProcess]:
    """One sweep over every fault: it must go on past each failure."""
    work = Workdir(folder)
    done = work.run(
        "sweep",
        *FAST,
        f"+fault={FAULTS}",
        f"launch.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
        "launch.max_result_mb=1",
    )
    return work, done


def rank_lifetime(work: Workdir, log_dir: str, rank: int) -> tuple[float, float | None, float]:
    """When the rank started (its pid file, written just before init_process_group), when it failed (its
    error file; None if it wrote none, e.g. killed by a signal) and when the run ended, as Unix times:
    what a rank lived through, apart from the launch around it, which a loaded machine stretches."""
    job = Path(log_dir)
    started = (job / "pids" / f"rank{rank}.pid").stat().st_mtime
    errors = list(job.glob(f"logs/*/attempt_0/{rank}/error.json"))
    failed = errors[0].stat().st_mtime if errors else None
    ((ended,),) = work.query("SELECT ended_at FROM runs WHERE log_dir = ?", log_dir)
    return started, failed, datetime.fromisoformat(ended).replace(tzinfo=UTC).timestamp()


def test_each_fault_is_recorded_with_its_rank_and_message(faulted):
    work, done = faulted
    assert done.returncode == 1
    rows = work.query("SELECT fault, status, failed_rank, error FROM runs ORDER BY id")
    assert [r[0] for r in rows] == FAULTS.split(",")  # the sweep went on past every failure
    by_fault = {fault: (status, rank, error) for fault, status, rank, error in rows}
    assert by_fault["raise_on_rank1"][:2] == ("FAILED", 1)
    assert "RuntimeError: injected fault raise_on_rank1" in by_fault["raise_on_rank1"][2]
    assert (
        by_fault["kill_on_rank1"][:2] == ("FAILED", 1)
        and "Signal 9 (SIGKILL)" in by_fault["kill_on_rank1"][2]
    )
    hang = by_fault["hang_on_rank1"]
    assert hang[:2] == ("TIMEOUT", 1) and "timed out" in hang[2].lower()
    assert by_fault["oom_on_rank1"][:2] == ("OOM", 1) and "allocate" in by_fault["oom_on_rank1"][2]
    assert by_fault["print_flood"] == ("OK", None, "")
    assert by_fault["big_result"][:2] == ("FAILED", 1)
    assert "over launch.max_result_mb=1" in by_fault["big_result"][2]
    # The CLI says each failure in one line, naming the run, its status and the message.
    failures = [line for line in done.stderr.splitlines() if line.startswith("run ")]
    assert len(failures) == 5 and all(" rank 1" in line for line in failures)


def test_a_hang_ends_within_the_collective_timeout(faulted):
    """Rank 1 fails once its lone all-reduce has waited the timeout (init_process_group before it takes a
    moment), by its own error (its error file; a rank stopped at the job's timeout writes none), which
    names the collective timeout; the run ends after it, rank 0 (waiting forever) stopped."""
    work, _ = faulted
    ((log_dir, error),) = work.query("SELECT log_dir, error FROM runs WHERE fault = 'hang_on_rank1'")
    started, failed, ended = rank_lifetime(work, log_dir, 1)
    assert failed is not None and COLLECTIVE_TIMEOUT_S <= failed - started
    assert f"(launch.collective_timeout_s={COLLECTIVE_TIMEOUT_S})" in error and "job_timeout_s" not in error
    assert failed <= ended


def test_faults_leave_no_worker_and_a_sound_database(faulted):
    work, _ = faulted
    assert work.live_workers() == []
    assert work.integrity() == "ok"
    # A failed run keeps its job folder (logs, error files) for a look, moved beside the database as
    # runs/logs/RUN_ID; an OK one is removed. Nothing stays in TMPDIR.
    kept = dict(work.query("SELECT id, log_dir FROM runs WHERE status != 'OK'"))
    assert len(kept) == 5 and all(Path(k) == work.db.parent / "logs" / str(i) for i, k in kept.items())
    assert all((Path(k) / "launcher.log").exists() for k in kept.values())
    assert work.query("SELECT log_dir FROM runs WHERE status = 'OK'") == [(None,)]
    assert not list(work.jobs.glob("tpbench-job-*"))


SUBGROUP_HANGS = "hang_in_tp_group,hang_in_dp_group,hang_in_kv_group"


@beside(waits=True)
def hung_in_subgroups(folder: Path) -> tuple[Workdir, subprocess.CompletedProcess]:
    work = Workdir(folder)
    done = work.run(
        "sweep",
        *FAST,
        f"+fault={SUBGROUP_HANGS}",
        "dp=2",
        "kv_heads=1",
        f"launch.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
        f"launch.job_timeout_s={COLLECTIVE_TIMEOUT_S + 90}",  # bounds a run whose group has no timeout
        timeout=600,
    )
    return work, done


def test_a_hang_inside_a_sub_group_ends_within_the_collective_timeout(hung_in_subgroups):
    """dp 2 x tp 2 with one KV head (replicated on both TP ranks): rank 1 all-reduces alone in its TP,
    DP or KV-replica group, which carry no timeout but the one tpbench gives every group it makes.
    Without it (seen: each fault, with ParallelContext.from_world giving its groups none) a run hangs
    until the job timeout stops it: recorded TIMEOUT too, but as a worker past launch.job_timeout_s."""
    work, done = hung_in_subgroups
    assert done.returncode == 1
    rows = work.query("SELECT fault, status, failed_rank, error, log_dir FROM runs ORDER BY id")
    assert [r[0] for r in rows] == SUBGROUP_HANGS.split(",")
    wrong = {}  # every fault checked, so that each one's failure shows
    for fault, status, rank, error, log_dir in rows:
        collective = "timed out" in error.lower() and f"collective_timeout_s={COLLECTIVE_TIMEOUT_S}" in error
        # without the timeout it would wait until the job's (its message then says job_timeout_s, and
        # rank 1, stopped, writes no error file); new_group's own sync comes before the hang
        started, failed, ended = rank_lifetime(work, log_dir, 1)
        own = failed is not None and COLLECTIVE_TIMEOUT_S <= failed - started and failed <= ended
        if (status, rank) != ("TIMEOUT", 1) or not collective or "job_timeout_s" in error or not own:
            wrong[fault] = (status, rank, failed and round(failed - started), error)
    assert wrong == {}
    assert work.live_workers() == []


def test_a_validation_out_of_bounds_is_a_failed_run_and_a_sweep_runs_it_again(tmp_path):
    """An error planted on rank 1 alone (debug.validate_fault=rank1_param: it adds 1 to its replica of
    model.norm.weight after the AdamW steps, DDP's replica, which no other rank's figures hold) fails the
    run end to end: recorded FAILED with the figure and the parameter, kept for a look, not done."""
    work = Workdir(tmp_path)
    done = work.run("sweep", *FAST, "mode=ddp", "debug.validate_fault=rank1_param")
    assert done.returncode == 1
    ((status, rank, error, log_dir),) = work.query("SELECT status, failed_rank, error, log_dir FROM runs")
    assert (status, rank) == ("FAILED", 0)
    assert (
        error.startswith("validate out of bounds: adamw_param_rel_l2 model.norm.weight ")
        and "> bound" in error
    )
    assert f"run 1 FAILED: {error}" in done.stderr
    assert Path(log_dir) == work.db.parent / "logs" / "1"  # kept for a look, beside the database
    assert (Path(log_dir) / "results" / "rank0.json").exists() and not list(work.jobs.glob("tpbench-job-*"))
    shown = work.invoke("runs", "show", "1")
    assert f"its logs: {log_dir}" in shown.stderr
    # what it measured is recorded: the failing figure beside the dense model's own error
    metrics = json.loads(work.invoke("runs", "show", "1", "--json").stdout)["metrics"]
    assert metrics["passed"] == 0.0 and metrics["adamw_param_max_abs"] > 0.5
    # not done: a sweep asks the database which configs have an OK run (test_a_second_sweep_skips_what_is_done
    # shows it skipping those), and this one has none
    ((config_hash,),) = work.query("SELECT config_hash FROM runs")
    assert config_hash not in {config for config, _ in ResultsDB(f"sqlite:///{work.db}").finished()}


def test_a_failed_database_write_keeps_the_job_folder_and_names_it(tmp_path):
    work = Workdir(tmp_path)
    ResultsDB(f"sqlite:///{work.db}")  # the schema, then a trigger that refuses every run
    with sqlite3.connect(work.db) as conn:
        conn.execute("CREATE TRIGGER no_runs BEFORE INSERT ON runs BEGIN SELECT RAISE(ABORT, 'no'); END")
    done = work.run("run", *FAST)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert "OK, but not recorded in sqlite:///runs/tpbench.db" in line and "IntegrityError: no" in line
    (job,) = list(work.jobs.glob("tpbench-job-*"))
    assert line.endswith(f"stay in {job}")
    assert (job / "config.yaml").exists() and (job / "results" / "rank0.json").exists()
    assert (job / "results" / "rank1.json").exists()
    assert work.query("SELECT count(*) FROM runs") == [(0,)]


def test_an_nccl_watchdog_abort_is_a_timeout(tmp_path):
    """NCCL's watchdog ends a rank stuck in a collective with SIGABRT, leaving no error file; its
    stderr has the reason. Without it, the same SIGABRT is a plain failure."""
    from torch.distributed.elastic.multiprocessing import ProcessFailure

    from tpbench.run.compose import expand
    from tpbench.run.launch import Status, _first_failure

    (cfg,) = expand(["kind=validate"])
    log = tmp_path / "logs" / "tpbench-x" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        "[rank1]:[E1130 06:12:01.000000000 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=300000) "
        "ran for 300012 milliseconds before timing out.\n"
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
    )
    abort = {1: ProcessFailure(local_rank=1, pid=4242, exitcode=-signal.SIGABRT, error_file="/nonexistent")}
    failed = _first_failure(abort, cfg, tmp_path)
    assert (failed.status, failed.rank) == (Status.TIMEOUT, 1)
    assert "Watchdog caught collective operation timeout" in failed.message
    assert failed.message.endswith("(launch.collective_timeout_s=300)")
    log.write_text("free(): invalid pointer\n")
    assert _first_failure(abort, cfg, tmp_path).status is Status.FAILED


def test_a_rank_stopped_by_sigterm_before_any_failure_is_an_interruption(tmp_path):
    """scancel signals every process of the job: a rank can die of SIGTERM (no error file) and its peer
    of the broken connection before the agent hears its own signal. No rank failed first: the run was
    stopped from outside (INTERRUPTED; under Slurm the following command records Slurm's reason). A
    rank that failed on its own before the agent stopped the others is the failure, as before."""
    from torch.distributed.elastic.multiprocessing import ProcessFailure

    from tpbench.run.compose import expand
    from tpbench.run.launch import Status, _first_failure

    (cfg,) = expand(["kind=validate"])

    def failed_with(rank: int, message: str) -> ProcessFailure:
        path = tmp_path / f"error{rank}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1"}}}))
        return ProcessFailure(local_rank=rank, pid=4200 + rank, exitcode=1, error_file=str(path))

    stopped = ProcessFailure(local_rank=0, pid=4200, exitcode=-signal.SIGTERM, error_file="/nonexistent")
    peer = failed_with(1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500")
    failed = _first_failure({0: stopped, 1: peer}, cfg, tmp_path)
    assert (failed.status, failed.rank) == (Status.INTERRUPTED, 0)
    assert failed.message.startswith("rank 0 stopped from outside the job: Signal 15 (SIGTERM)")
    own = failed_with(1, "ValueError: a rank's own error")
    failed = _first_failure({0: stopped, 1: own}, cfg, tmp_path)
    assert (failed.status, failed.rank) == (Status.FAILED, 1) and "a rank's own error" in failed.message


def test_ctrl_c_interrupts_the_current_run_and_a_rerun_finishes_the_rest(tmp_path):
    work = Workdir(tmp_path)
    # 40 steps (the first job is still running when Ctrl-C comes), checked at 1, 20 and 40 only: the
    # rerun's 40 steps are what this test pays for
    sweep = ["sweep", "kind=validate", "validate.steps=40,2", "validate.every=20"]
    cli = work.start(*sweep)
    deadline = time.monotonic() + 120
    while not list(work.jobs.glob("*/pids/rank1.pid")):  # the first job's workers are up
        assert time.monotonic() < deadline and cli.poll() is None
        time.sleep(0.1)
    time.sleep(0.5)
    cli.send_signal(signal.SIGINT)
    _, stderr = cli.communicate(timeout=60)
    assert cli.returncode == 130, stderr
    assert work.query("SELECT status, error FROM runs") == [("INTERRUPTED", "interrupted by SIGINT")]
    assert work.live_workers() == []
    assert work.integrity() == "ok"

    rerun = work.run(*sweep)
    assert rerun.returncode == 0, rerun.stderr
    rows = work.query("SELECT status, json_extract(config, '$.validate.steps') FROM runs ORDER BY id")
    assert rows == [("INTERRUPTED", 40), ("OK", 40), ("OK", 2)]
    assert work.query("SELECT count(*) FROM runs WHERE status = 'OK' GROUP BY config_hash") == [(1,), (1,)]


def test_four_sweeps_share_one_sqlite_file(tmp_path):
    work = Workdir(tmp_path)
    clis = [work.start("sweep", *FAST, "tp=1", f"train.seed={seed}") for seed in range(4)]  # one rank each
    outputs = [cli.communicate(timeout=600) for cli in clis]
    for cli, (_, stderr) in zip(clis, outputs, strict=True):
        assert cli.returncode == 0, stderr
        assert "locked" not in stderr
    seeds = work.query("SELECT json_extract(config, '$.train.seed'), status FROM runs ORDER BY 1")
    assert seeds == [(seed, "OK") for seed in range(4)]
    assert work.query("SELECT count(DISTINCT run_id) FROM measurements") == [(4,)]
    assert work.integrity() == "ok"


def rendezvous_port() -> int:
    """A free port for two nodes' rendezvous, below Linux's ephemeral range (32768-60999). A port
    taken with bind(0) and let go is ephemeral: until the nodes' agents bind it, another job's
    `torchrun --standalone` (bind(0) too) can take it, and both nodes then meet in that job's store,
    which goes with that job, failing whichever node touches it next."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    below = range(20000, low) if low > 20200 else range(low - 200, low)
    for port in random.Random().sample(below, 200):
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {below}")


def test_two_nodes_meet_through_the_rendezvous_and_rank0s_node_records(tmp_path):
    work = Workdir(tmp_path)
    port = rendezvous_port()
    common = [*FAST, "launch.nnodes=2", "launch.nproc_per_node=1", f"launch.rdzv_endpoint=localhost:{port}"]
    nodes = [work.start("run", *common, f"launch.node_rank={rank}") for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    said = "\n".join(f"node {rank}'s stderr:\n{stderr}" for rank, (_, stderr) in enumerate(outputs))
    assert [node.returncode for node in nodes] == [0, 0], said
    assert work.query("SELECT status, world_size, tp FROM runs") == [("OK", 2, 2)]
    assert sum("records it" in stderr for _, stderr in outputs) == 1


def test_a_node_without_rank_0_says_why_its_ranks_failed(tmp_path):
    """The node of rank 0 records the run, but only this node saw its own rank's error: it says it."""
    work = Workdir(tmp_path)
    port = rendezvous_port()
    # rank 0 learns of rank 1's end from its collective's timeout, or from its agent losing the
    # rendezvous store where node 1's agent hosted it
    common = [*FAST, "+fault=raise_on_rank1", "launch.nnodes=2", "launch.nproc_per_node=1"]
    common += [f"launch.rdzv_endpoint=localhost:{port}", "launch.collective_timeout_s=15"]
    nodes = [work.start("run", *common, f"launch.node_rank={rank}") for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [1, 1], outputs
    said = [line for line in outputs[1][1].splitlines() if "the node that ran rank 0 records it" in line]
    assert len(said) == 1 and "on this node: rank 1: " in said[0] and "(logs: " in said[0], said
    assert work.query("SELECT status FROM runs") in ([("FAILED",)], [("TIMEOUT",)])


def test_the_default_run_is_the_tiny_model_with_every_kind(tmp_path):
    work = Workdir(tmp_path)
    done = work.run("run", "--json")
    assert done.returncode == 0, done.stderr
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert [p["kind"] for p in printed] == ["validate", "memory", "throughput"]
    assert "estimate" not in done.stderr and " step " not in done.stderr  # --json: no progress either
    every = {"comm_bytes_per_step", "predicted_comm_bytes_per_step"}
    expected = {
        "validate": VALIDATE_METRICS,
        "memory": {"peak_bytes", "predicted_peak_bytes", *every},
        "throughput": {"step_time_s", "tokens_per_s", "first_step_s", "comm_hidden_fraction", *every},
    }
    for p in printed:
        assert (p["status"], p["mode"], p["tp"], p["dp"], p["backend"]) == ("OK", "tp", 2, 1, "gloo")
        assert (p["hidden"], p["layers"], p["heads"], p["kv_heads"], p["vocab"], p["seq"]) == (
            64,
            2,
            8,
            4,
            256,
            32,
        )
        assert expected[p["kind"]] <= set(p["metrics"]), p["kind"]


def test_a_worker_past_the_job_timeout_is_stopped_and_recorded(tmp_path):
    work = Workdir(tmp_path)
    done = work.run("run", "kind=validate", "validate.steps=1000000", "launch.job_timeout_s=3")
    assert done.returncode == 1
    ((status, rank, error, log_dir),) = work.query("SELECT status, failed_rank, error, log_dir FROM runs")
    assert status == "TIMEOUT" and rank in (0, 1) and error.endswith("ran past launch.job_timeout_s=3")
    started, _, ended = rank_lifetime(work, log_dir, rank)  # its alarm is set as it starts
    assert 3 <= ended - started < 3 + 10
    assert work.live_workers() == []


def test_a_killed_launcher_takes_its_workers_with_it(tmp_path):
    work = Workdir(tmp_path)
    cli = work.start("run", "kind=validate", "validate.steps=1000000")
    try:
        deadline = time.monotonic() + 120
        while len(list(work.jobs.glob("*/pids/rank*.pid"))) < 2:
            assert time.monotonic() < deadline and cli.poll() is None
            time.sleep(0.1)
        time.sleep(2)  # past init_process_group: the workers no longer need the launcher's store
        assert len(work.live_workers()) == 2
        cli.kill()  # SIGKILL: the launcher has no say; the workers' parent-death signal does
        cli.communicate()
        deadline = time.monotonic() + 10
        while work.live_workers():
            assert time.monotonic() < deadline, work.live_workers()
            time.sleep(0.1)
    finally:
        cli.kill()
        for pid in work.live_workers():
            os.kill(pid, signal.SIGKILL)
