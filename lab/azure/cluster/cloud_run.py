"""``lab watch`` and ``lab drill``: the cloud run, observed and reported like the local lab.

``watch`` follows the job and, when stopped (Ctrl-C, or the job ends), writes the report of
what it saw. ``drill`` is the cloud twin of ``make lab``: it waits until training runs at full
size, evicts one Spot node through ``simulate-eviction``, waits until training runs again and
the replacement has joined, N times, then writes the same report. Both write the run's logs
in the layout ``lab report --logs`` reads, and build the report from there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.azure.cluster.job_watcher import JobWatcher
from lab.azure.cluster.kube import (
    EVICTION_OUTPUTS,
    BadOutputs,
    Cluster,
    ClusterError,
    full_world_size,
    job_phase,
    procs_per_worker,
    read_target,
)
from lab.azure.cluster.recorder import Recorder
from lab.exit_status import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from lab.live.event_log import LabEventLog
from lab.live.status_line import StatusLine
from lab.report.run_logs import DRILL_EVENTS, WATCH_EVENTS, RunLogsError, load_cluster_run
from lab.report.run_report import cost_of_run, report_from_run, write_outputs
from lab.report.text import format_report

ENDED = ("Succeeded", "Failed")
Prices = Callable[[], tuple[float | None, float | None, str]]
TICK_S = 1.0


@dataclass
class CloudOptions:
    stack_outputs: Path
    out: Path
    prices: Prices = lambda: (None, None, "no prices given")


def _report(out: Path, prices: Prices) -> dict[str, Any] | None:
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


def _max_steps(recorder: Recorder) -> int | None:
    started = [r for r in recorder.records if r.get("event") == "started" and "max_steps" in r]
    return started[-1]["max_steps"] if started else None


def watch(
    options: CloudOptions,
    cluster: Cluster | None = None,
    until: Callable[[], bool] = lambda: False,
    status: StatusLine | None = None,
) -> int:
    """Follow the job until Ctrl-C, the job's end, or ``until()``; then write the report."""
    try:
        cluster = cluster or Cluster(read_target(options.stack_outputs))
        phase = job_phase(cluster.job())
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(err, BadOutputs) else EXIT_FAILED
    recorder = Recorder(options.out)
    # The span watched: the report covers it, the logs before it only give the context.
    span = LabEventLog(options.out / WATCH_EVENTS)
    span.write("run_started")
    watcher = JobWatcher(cluster, recorder)
    status = status or StatusLine()
    watcher.start()
    try:
        while phase not in ENDED and not until():
            for notice in watcher.notices():
                status.message(f"warning: {notice}")
            status.update(recorder.status(phase, _max_steps(recorder)))
            time.sleep(TICK_S)
            try:
                phase = job_phase(cluster.job())
            except ClusterError as err:
                status.message(f"warning: {err}")
    except KeyboardInterrupt:
        status.message("stopped watching; the job goes on")
    finally:
        watcher.close()
        span.write("run_ended")
        status.message(recorder.status(phase, _max_steps(recorder)))  # where it ended
        status.close()
    return EXIT_OK if _report(options.out, options.prices) is not None else EXIT_FAILED


@dataclass
class DrillOptions:
    """How many evictions, and how long to wait for each stage."""

    evictions: int = 1
    interval_s: float = 60.0
    """Training at full size between evictions."""
    ready_timeout_s: float = 600.0
    """For the job to train at full size before the first eviction."""
    recover_timeout_s: float = 1800.0
    """For training to run again, and for the replacement to join, after each eviction."""
    settle_lines: int = 3
    """Metrics lines at a size before it counts as training at that size."""


Evict = Callable[[str], int]
"""Evicts the Spot VM behind a Kubernetes node; returns simulate-eviction's exit code."""


def _trains_at(recorder: Recorder, since: int, world: int, lines: int) -> bool:
    """``lines`` metrics lines at ``world`` among the records that arrived after ``since``."""
    new = recorder.records[since:]
    return sum(1 for r in new if r["kind"] == "metrics" and r["world_size"] == world) >= lines


def _wait(condition: Callable[[], bool], timeout_s: float, tick: Callable[[], None]) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        tick()
        time.sleep(TICK_S)
    return True


def _victim(recorder: Recorder) -> tuple[str, str] | None:
    """The worker to evict: the last by name that runs on a node (worker-0 often holds the
    rendezvous' first rank; any node works, the choice only makes runs comparable)."""
    placed = sorted((pod, node) for pod, node in recorder.pods.items() if node)
    return placed[-1] if placed else None


def _evict_once(
    index: int,
    plan: DrillOptions,
    full: int,
    per_node: int,
    recorder: Recorder,
    log: LabEventLog,
    evict: Evict,
    status: StatusLine,
    trains_at: Callable[[int, int, float], bool],
) -> int:
    """One eviction: wait at full size, evict, wait for training, wait for the replacement."""
    if index:
        trains_at(full, len(recorder.records), plan.interval_s)  # a while at full size
    victim = _victim(recorder)
    if victim is None:
        status.message("error: no worker pod runs on a node")
        return EXIT_FAILED
    pod, node = victim
    status.message(f"evicting {node} ({pod}), {index + 1} of {plan.evictions}")
    injected_at = time.time()
    if evict(node) != 0:
        return EXIT_FAILED
    smaller = full - per_node
    log.write(
        "fault_injected",
        index=index,
        kind="evict",
        description=f"evict {pod}'s node",
        injected_at=injected_at,  # unrounded: the job may react within the millisecond
        planned_world_size=smaller,
        node=node,
    )
    mark = len(recorder.records)
    if not trains_at(smaller, mark, plan.recover_timeout_s):
        status.message(f"training did not run again within {plan.recover_timeout_s:.0f} s")
        return EXIT_FAILED
    # Counted from here: lines at full size logged before the loss was noticed do not count.
    if not trains_at(full, len(recorder.records), plan.recover_timeout_s):
        status.message(f"no replacement joined within {plan.recover_timeout_s:.0f} s")
        return EXIT_FAILED
    return EXIT_OK


def drill(
    options: CloudOptions,
    plan: DrillOptions,
    evict: Evict,
    cluster: Cluster | None = None,
    status: StatusLine | None = None,
) -> int:
    """Evict ``plan.evictions`` Spot nodes, one at a time, each once training ran at full size
    again; write the report. Refuses to start on a job that is not training at full size."""
    try:
        target = read_target(options.stack_outputs, also=EVICTION_OUTPUTS)  # before waiting
        cluster = cluster or Cluster(target)
        job = cluster.job()
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(err, BadOutputs) else EXIT_FAILED
    phase, full = job_phase(job), full_world_size(job)
    if phase != "Running":
        print(f"error: the job is {phase}, not Running: drill only a healthy job", file=sys.stderr)
        return EXIT_FAILED
    per_node = procs_per_worker(job)
    recorder = Recorder(options.out)
    log = LabEventLog(options.out / DRILL_EVENTS)
    watcher = JobWatcher(cluster, recorder)
    status = status or StatusLine()
    watcher.start()

    def tick() -> None:
        for notice in watcher.notices():
            status.message(f"warning: {notice}")
        status.update(recorder.status(phase, _max_steps(recorder)))

    def trains_at(world: int, since: int, timeout_s: float) -> bool:
        return _wait(lambda: _trains_at(recorder, since, world, plan.settle_lines), timeout_s, tick)

    outcome = EXIT_OK
    try:
        if not trains_at(full, 0, plan.ready_timeout_s):
            print(
                f"error: the job does not train at its full size (world {full}) within "
                f"{plan.ready_timeout_s:.0f} s (world {recorder.view.world_size} now): drill "
                "only a healthy job",
                file=sys.stderr,
            )
            return EXIT_FAILED
        log.write("run_started", evictions=plan.evictions, full_world_size=full)
        for index in range(plan.evictions):
            outcome = _evict_once(
                index, plan, full, per_node, recorder, log, evict, status, trains_at
            )
            if outcome != EXIT_OK:
                break
        log.write("run_ended")
    except KeyboardInterrupt:
        status.message("drill stopped; the job goes on")
        log.write("run_ended")
        outcome = EXIT_FAILED
    finally:
        watcher.close()
        status.close()
    report = _report(options.out, options.prices)
    return outcome if report is not None else EXIT_FAILED
