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

from catalog.gpu_pools import ON_DEMAND, node_kind
from lab.azure.cluster.follow import TICK_S, CloudOptions, JobFollower, write_report
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
from lab.live.event_log import LabEventLog
from lab.live.status_line import StatusLine
from lab.report.run_logs import DRILL_EVENTS, WATCH_EVENTS
from training.elastic.exit_codes import BAD_INPUT, OK, PERMANENT

ENDED = ("Succeeded", "Failed")


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
        return BAD_INPUT if isinstance(err, BadOutputs) else PERMANENT
    follower = JobFollower(cluster, options.out, status, phase)
    # The span watched: the report covers it, the logs before it only give the context.
    span = LabEventLog(options.out / WATCH_EVENTS)
    span.write("run_started")
    follower.start()
    try:
        while follower.phase not in ENDED and not until():
            follower.tick()
            time.sleep(TICK_S)
            try:
                follower.phase = job_phase(cluster.job())
            except ClusterError as err:
                follower.status.message(f"warning: {err}")
    except KeyboardInterrupt:
        follower.status.message("stopped watching; the job goes on")
    finally:
        span.write("run_ended")
        follower.close(last=follower.where())  # where it ended
    return OK if write_report(options.out, options.prices) is not None else PERMANENT


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


Evict = Callable[[str], int]
"""Evicts the Spot VM behind a Kubernetes node; returns simulate-eviction's exit code."""


def _victim(pods: dict[str, str]) -> tuple[str, str] | None:
    """The worker to evict: the last by name that runs on a Spot node (worker-0 often holds
    the rendezvous' first rank; any node works, the choice only makes runs comparable). A node
    of the on-demand fallback pool cannot be evicted: Azure simulates evictions of Spot VMs."""
    placed = sorted(
        (pod, node) for pod, node in pods.items() if node and node_kind(node) != ON_DEMAND
    )
    return placed[-1] if placed else None


def _evict_once(
    index: int,
    plan: DrillOptions,
    full: int,
    per_node: int,
    follower: JobFollower,
    log: LabEventLog,
    evict: Evict,
) -> int:
    """One eviction: wait at full size, evict, wait for training, wait for the replacement."""
    status = follower.status
    if index:
        follower.trains_at(full, follower.mark(), plan.interval_s)  # a while at full size
    victim = _victim(follower.recorder.pods)
    if victim is None:
        status.message("error: no worker pod runs on a Spot node")
        return PERMANENT
    pod, node = victim
    status.message(f"evicting {node} ({pod}), {index + 1} of {plan.evictions}")
    injected_at = time.time()
    if evict(node) != 0:
        return PERMANENT
    log.write(
        "fault_injected",
        index=index,
        kind="evict",
        description=f"evict {pod}'s node",
        injected_at=injected_at,  # unrounded: the job may react within the millisecond
        planned_world_size=full - per_node,
        node=node,
    )
    return OK if rejoined(follower, full, per_node, plan.recover_timeout_s) else PERMANENT


def rejoined(follower: JobFollower, full: int, per_node: int, timeout_s: float) -> bool:
    """After a worker was taken away: the group trains again without it, then at full size
    once its replacement joined; each within ``timeout_s``, said when not."""
    if not follower.trains_at(full - per_node, follower.mark(), timeout_s):
        follower.status.message(f"training did not run again within {timeout_s:.0f} s")
        return False
    # Counted from here: lines at full size logged before the loss was noticed do not count.
    if not follower.trains_at(full, follower.mark(), timeout_s):
        follower.status.message(f"no replacement joined within {timeout_s:.0f} s")
        return False
    return True


def open_job(
    options: CloudOptions, what: str, cluster: Cluster | None, also: tuple[str, ...] = ()
) -> tuple[Cluster, int, int] | int:
    """The cluster, the job's full world size and processes per worker, for a command that acts
    on a Running job; else the exit status, with why on stderr (bad outputs, an unreachable
    cluster, a job that is not Running)."""
    try:
        target = read_target(options.stack_outputs, also=also)  # before waiting on anything
        cluster = cluster or Cluster(target)
        job = cluster.job()
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT if isinstance(err, BadOutputs) else PERMANENT
    phase = job_phase(job)
    if phase != "Running":
        print(f"error: the job is {phase}, not Running: {what} only a healthy job", file=sys.stderr)
        return PERMANENT
    return cluster, full_world_size(job), procs_per_worker(job)


def drill(
    options: CloudOptions,
    plan: DrillOptions,
    evict: Evict,
    cluster: Cluster | None = None,
    status: StatusLine | None = None,
) -> int:
    """Evict ``plan.evictions`` Spot nodes, one at a time, each once training ran at full size
    again; write the report. Refuses to start on a job that is not training at full size."""
    opened = open_job(options, "drill", cluster, also=EVICTION_OUTPUTS)
    if isinstance(opened, int):
        return opened
    cluster, full, per_node = opened
    follower = JobFollower(cluster, options.out, status)
    log = LabEventLog(options.out / DRILL_EVENTS)
    follower.start()
    outcome = OK
    try:
        if not at_full_size(follower, full, plan.ready_timeout_s, "drill"):
            return PERMANENT
        log.write("run_started", evictions=plan.evictions, full_world_size=full)
        for index in range(plan.evictions):
            outcome = _evict_once(index, plan, full, per_node, follower, log, evict)
            if outcome != OK:
                break
        log.write("run_ended")
    except KeyboardInterrupt:
        follower.status.message("drill stopped; the job goes on")
        log.write("run_ended")
        outcome = PERMANENT
    finally:
        follower.close()
    report = write_report(options.out, options.prices)
    return outcome if report is not None else PERMANENT


def at_full_size(follower: JobFollower, full: int, timeout_s: float, what: str) -> bool:
    """Whether the job trains at its full size within ``timeout_s``; said on stderr if not."""
    if follower.trains_at(full, 0, timeout_s):
        return True
    print(
        f"error: the job does not train at its full size (world {full}) within "
        f"{timeout_s:.0f} s (world {follower.recorder.view.world_size} now): {what} "
        "only a healthy job",
        file=sys.stderr,
    )
    return False
