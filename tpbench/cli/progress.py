"""What `tpbench run` and `tpbench sweep` say of their runs on stderr: before, the estimates
(tpbench.sizing.estimate); as they go, each run's progress line and, for a sweep, runs, ok, failed, elapsed
and remaining.

On a terminal the progress is live (rich: a status line for `run`, a progress bar for `sweep`). Where
stderr is not a terminal (a CI log, a pipe) it is plain lines instead: a run's progress at most every
PLAIN_EVERY_S seconds (the same line again every SAME_EVERY_S), and a line at each run's end when
there are several, so a long run in a log is never silent. Under --json nothing is said at all. A
sweep's remaining time is its runs' estimates, scaled by how the finished runs compared with theirs.

Like is compared with like: an estimate's launch (tpbench.sizing.estimate.LAUNCH_S) is the whole
command's fixed cost, its own start (imports, composing, the database) as well as torchrun's and the
workers', so the first run's time counts from the command's start (the process's, not the first
progress line's), and so does the sweep's elapsed time: it is the command's wall time so far.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
)
from rich.table import Column
from rich.text import Text

from tpbench.cli.arguments import one_line
from tpbench.cli.output import err
from tpbench.config import RunConfig, run_label

if TYPE_CHECKING:
    from tpbench.run.sweep import Ran


def command_started() -> float:
    """When this process started, on time.monotonic's clock (Linux: /proc/self/stat's start time on
    CLOCK_BOOTTIME); elsewhere when tpbench.cli.progress was imported, a fraction of a second later."""
    try:
        with open("/proc/self/stat") as stat:  # field 22, after the command name in parentheses
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED
    return time.monotonic() - max(0.0, age)


_IMPORTED = time.monotonic()
PLAIN_EVERY_S = 10.0
SAME_EVERY_S = 60.0  # a step that lasts: its line again, so that a log is never silent for long


def _beside_the_one_before(group: list[RunConfig]) -> list[bool]:
    """Per run of a batch: whether it is validated beside the run before it (launch.share_dense)."""
    from tpbench.experiments.dense_side import groups_beside

    return [i > 0 for _, count in groups_beside(group) for i in range(count)]


def say_estimates(configs: Sequence[RunConfig], sweep: bool) -> list[float]:
    """Print the runs' estimates on stderr (one line per run; a sweep's total and longest in one), a
    line for each run estimated long and for each dtype with no fast kernel here; their seconds. None
    to run (a sweep whose every config is done): nothing said, and the time model is not imported."""
    if not configs:
        return []
    from dataclasses import replace

    from tpbench.predict import rate_probe
    from tpbench.run import batch
    from tpbench.sizing import estimate

    estimates = []
    for group in batch.batches(configs):
        beside = _beside_the_one_before(group)
        each = [
            replace(estimate.estimate(c, beside=b), warm=i > 0)
            for i, (c, b) in enumerate(zip(group, beside, strict=True))
        ]
        estimates += estimate.share_dense_sides(each, beside)
    if sweep and len(estimates) > 1:
        longest = max(estimates, key=lambda e: e.seconds)
        total = sum(e.seconds for e in estimates)
        one_line(
            f"estimate: {len(estimates)} runs, ~{estimate.duration(total)} in all; the longest "
            f"~{estimate.duration(longest.seconds)} ({run_label(longest.cfg)} {longest.cfg.train.dtype})"
        )
    else:
        for e in estimates:
            one_line(e.line())
    for e in estimates:
        if e.seconds > estimate.LONG_RUN_S:
            one_line(
                f"long run: {run_label(e.cfg)} {e.cfg.train.dtype} is estimated at "
                f"~{estimate.duration(e.seconds)}; its steps show as it goes"
            )
    slow = {}
    for e in estimates:
        for dtype in e.flops:
            slow.setdefault(dtype, rate_probe.slow_kernel_line(dtype, e.cfg, e.threads))
    for line in filter(None, slow.values()):
        one_line(line)
    if any(c.kind == "memory" for c in configs) and any(
        c.launch.device == "cuda" or c.train.compile for c in configs
    ):
        one_line(
            "memory runs eager: the memory model counts eager tensors (train.compile applies to "
            "throughput and validate runs)"
        )
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if estimates and load > cores:
        one_line(
            f"this machine's load is {load:.1f} on {cores} cores: the runs will take longer than "
            "estimated (the estimates are for a machine the run has to itself)"
        )
    return [e.seconds for e in estimates]


class RunsProgress:
    """The progress of the runs of one command, as `run_each` reports them (on_start, ended)."""

    def __init__(
        self,
        estimates: Sequence[float],
        quiet: bool,
        sweep: bool,
        skipped: int = 0,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
    ):
        """`started`: when the command started, on `clock` (command_started()); the first run's time and
        the elapsed time count from it, as the estimates' launch does. None: from now."""
        self.estimates, self.quiet, self.sweep, self.skipped = list(estimates), quiet, sweep, skipped
        self.clock = clock
        self.live = not quiet and err.is_terminal
        self.counts = {"OK": 0, "failed": 0}
        self.took: list[float] = []  # seconds of each finished run
        self.started = self.run_started = clock() if started is None else started
        self.from_command = started is not None
        self.label = self.last = ""
        self.said = 0.0
        self.lock = threading.Lock()  # progress lines come from the launcher's tail thread
        self.status = err.status("") if self.live and not sweep else None
        self.bar = _bar(self) if self.live and sweep else None
        self.task = self.bar.add_task("sweep", total=len(self.estimates), ok=0, failed=0) if self.bar else 0

    def __enter__(self) -> RunsProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.stop()
        if self.bar is not None:
            self.bar.stop()
        elif self.sweep and not self.quiet:
            one_line(f"sweep: {self._counts()} · {_clock(self.clock() - self.started)} elapsed")

    def on_start(self, cfg: RunConfig) -> Callable[[str], None]:
        first = not self.took  # its estimate's launch includes the command's own start
        self.label, self.said = run_label(cfg), 0.0
        self.run_started = self.started if first else self.clock()
        if self.status is not None:
            self.status.update(escape(f"{self.label}: starting"))
            self.status.start()
        if self.bar is not None:
            self.bar.update(self.task, description=escape(self.label))
        return self._line

    def ended(self, ran: Ran) -> None:
        took = self.clock() - self.run_started
        self.took.append(took)
        self.counts["OK" if ran.status == "OK" else "failed"] += 1
        if self.status is not None:
            self.status.stop()  # the run's table prints next
        if self.bar is not None:
            counts = self.counts
            self.bar.update(
                self.task, advance=1, ok=counts["OK"], failed=counts["failed"], description="sweep"
            )
        elif not self.quiet and len(self.estimates) > 1:
            i = len(self.took) - 1
            since = " from the command's start" if i == 0 and self.from_command else ""
            estimated = f"estimated ~{self.estimates[i]:.0f} s"
            one_line(f"{self.label}: {ran.status} in {took:.1f} s{since} ({estimated})")

    def remaining(self) -> float:
        """Seconds left: the estimates of the runs to come and what is left of this one's, each scaled
        by the finished runs' time over their estimates."""
        done = len(self.took)
        if done >= len(self.estimates):
            return 0.0
        scale = sum(self.took) / sum(self.estimates[:done]) if done else 1.0
        current = max(0.0, scale * self.estimates[done] - (self.clock() - self.run_started))
        return current + scale * sum(self.estimates[done + 1 :])

    def _line(self, line: str) -> None:
        with self.lock:
            if self.status is not None:
                self.status.update(escape(f"{self.label}: {line}"))
            elif self.bar is not None:
                self.bar.update(self.task, description=escape(f"{self.label}: {line}"))
            elif not self.quiet and self._due(line):
                self.said, self.last = self.clock(), line
                where = f"[{self._counts()} · ~{_clock(self.remaining())} left] " if self.sweep else ""
                one_line(f"{where}{self.label}: {line}")

    def _due(self, line: str) -> bool:
        """A plain line: the run's first, then a new one every PLAIN_EVERY_S, the same every SAME_EVERY_S."""
        since = self.clock() - self.said
        return not self.said or since >= (PLAIN_EVERY_S if line != self.last else SAME_EVERY_S)

    def _counts(self) -> str:
        ok, failed = self.counts["OK"], self.counts["failed"]
        runs = f"{len(self.took)}/{len(self.estimates)} runs"
        return f"{runs} · ok {ok} · failed {failed} · skipped {self.skipped}"


class _Remaining(ProgressColumn):
    """The sweep's remaining time from the estimates (RunsProgress.remaining)."""

    def __init__(self, runs: RunsProgress):
        super().__init__()
        self.runs = runs

    def render(self, task) -> Text:
        return Text(f"~{_clock(self.runs.remaining())} left", style="progress.remaining")


class _Elapsed(ProgressColumn):
    """The command's wall time so far (RunsProgress.started), as the estimates count it."""

    def __init__(self, runs: RunsProgress):
        super().__init__()
        self.runs = runs

    def render(self, task) -> Text:
        return Text(_clock(self.runs.clock() - self.runs.started), style="progress.elapsed")


def _bar(runs: RunsProgress) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn(
            "{task.description}", table_column=Column(max_width=60, no_wrap=True, overflow="ellipsis")
        ),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(f"ok {{task.fields[ok]}} · failed {{task.fields[failed]}} · skipped {runs.skipped}"),
        _Elapsed(runs),
        _Remaining(runs),
        console=err,
    )


def _clock(seconds: float) -> str:
    """0:12, 3:05, 1:02:03."""
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
