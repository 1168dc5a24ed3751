"""Following the job while a command watches it or acts on it: what ``lab watch``, ``lab drill``
and ``lab rebalance`` share.

A ``JobFollower`` streams the job's pods, logs and events into a ``Recorder``, shows the status
line with every dropped stream, capacity event and failed mount as a line of its own, and waits
for the group to train at a world size. ``write_report`` builds the run's report from what was
recorded, the same way ``lab report --logs`` does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.azure.cluster.job_watcher import JobWatcher
from lab.azure.cluster.kube import Cluster
from lab.azure.cluster.mount_failures import MountFailures
from lab.azure.cluster.recorder import Recorder
from lab.live.status_line import StatusLine
from lab.report.gpu_cost import Prices, cost_of_run
from lab.report.run_logs import RunLogsError, load_cluster_run
from lab.report.run_report import report_from_run, write_outputs
from lab.report.text import format_report
from training.records import METRICS, STARTED

TICK_S = 1.0


@dataclass
class CloudOptions:
    stack_outputs: Path
    out: Path
    prices: Prices = lambda: (None, None, "no prices given")


def write_report(out: Path, prices: Prices) -> dict[str, Any] | None:
    """The report of what was recorded in ``out``, priced, written and printed; None (said on
    stderr) when the logs hold nothing to report."""
    try:
        run = load_cluster_run(out)
    except RunLogsError as err:
        print(f"no report: {err}", file=sys.stderr)
        return None
    report = report_from_run(run)
    report["cost"] = cost_of_run(run, *prices())
    write_outputs(out, run, report)
    print(format_report(report))
    print(f"report: {out / 'report.json'}  plot: {out / 'timeline.png'}")
    return report


def max_steps(recorder: Recorder) -> int | None:
    """The run's max_steps, from the newest ``started`` record that says it."""
    started = [r for r in recorder.records if r.get("event") == STARTED and "max_steps" in r]
    return started[-1]["max_steps"] if started else None


def trains_at(recorder: Recorder, since: int, world: int, lines: int) -> bool:
    """``lines`` metrics lines at ``world`` among the records that arrived after ``since``."""
    new = recorder.records[since:]
    return sum(1 for r in new if r["kind"] == METRICS and r["world_size"] == world) >= lines


def wait_for(condition: Callable[[], bool], timeout_s: float, tick: Callable[[], None]) -> bool:
    """Whether ``condition`` came true within ``timeout_s``, calling ``tick`` meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        tick()
        time.sleep(TICK_S)
    return True


class JobFollower:
    """The job's streams, what they recorded, and the status line that shows them."""

    def __init__(
        self, cluster: Cluster, out: Path, status: StatusLine | None = None, phase: str = "Running"
    ) -> None:
        self.cluster = cluster
        target = cluster.target
        self.recorder = Recorder(out, mounts=MountFailures(target.namespace, target.job))
        self.watcher = JobWatcher(cluster, self.recorder)
        self.status = status or StatusLine()
        self.phase = phase
        self.settle_lines = 3
        """Metrics lines at a size before it counts as training at that size."""

    def start(self) -> None:
        self.watcher.start()

    def where(self) -> str:
        """The status line's text: the job's phase, pods, world, step, loss and last events."""
        return self.recorder.status(self.phase, max_steps(self.recorder))

    def tick(self) -> None:
        """Show what is new: dropped streams, capacity events, volumes that fail to mount, and
        the status line."""
        for notice in self.watcher.notices():
            self.status.message(f"warning: {notice}")
        for line in self.recorder.said():
            self.status.message(line)
        self.status.update(self.where())

    def trains_at(self, world: int, since: int, timeout_s: float) -> bool:
        """Whether the group trains at ``world`` (records after index ``since``) in time."""
        return wait_for(
            lambda: trains_at(self.recorder, since, world, self.settle_lines), timeout_s, self.tick
        )

    def mark(self) -> int:
        """Where the records are now: later waits count only what arrives after it."""
        return len(self.recorder.records)

    def close(self, last: str | None = None) -> None:
        """Stop the streams; ``last`` stays on screen."""
        self.watcher.close()
        for line in self.recorder.said():
            self.status.message(line)
        if last is not None:
            self.status.message(last)
        self.status.close()
