"""Run times compared like with like (issue 35): an estimate's launch is the command's whole fixed cost
(its own start, torchrun's, the workers' imports), so the first run's time and a sweep's elapsed time
count from the command's start, not from the first progress line ("OK in 4.0 s (estimated ~11 s)" for
a command of 10.9 s; "0:05 elapsed" for 10.6 s of wall time). With a clock of its own, in one process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from test_estimate import config, vary

from tpbench.cli import progress
from tpbench.run.sweep import Ran


def test_the_first_run_and_the_elapsed_time_count_from_the_commands_start(capsys):
    configs = [vary(config("kind=memory"), "model", num_hidden_layers=L) for L in (1, 2)]
    now = [106.0]  # the command started at 100: 6 s of imports, composing, estimates, the database
    runs = progress.RunsProgress([11.0, 1.0], quiet=False, sweep=True, clock=lambda: now[0], started=100.0)
    with runs:
        runs.on_start(configs[0])
        now[0] += 4  # its steps, after torchrun's start
        assert runs.remaining() == 1.0 + 1.0  # 10 s of its 11 are spent
        runs.ended(Ran(1, configs[0], "OK"))
        now[0] += 0.5  # recording it
        runs.on_start(configs[1])
        now[0] += 0.5
        runs.ended(Ran(2, configs[1], "OK"))
    assert capsys.readouterr().err.splitlines() == [
        "memory tp tp=2 dp=1 layers=1: OK in 10.0 s from the command's start (estimated ~11 s)",
        "memory tp tp=2 dp=1 layers=2: OK in 0.5 s (estimated ~1 s)",
        "sweep: 2/2 runs · ok 2 · failed 0 · skipped 0 · 0:11 elapsed",
    ]


def test_the_command_starts_when_its_process_does():
    """command_started() is the process's start, before its imports: a child that sleeps 1.5 s before
    importing tpbench says so."""
    code = (
        "import time; time.sleep(1.5); from tpbench.cli import progress; "
        "print(time.monotonic() - progress.command_started())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    age = float(done.stdout)
    assert 1.5 <= age <= time.monotonic() - started + 0.05
