"""``lab rebalance``: the job back on Spot once Spot has capacity again.

With the on-demand fallback on, workers that found no Spot capacity run on on-demand nodes,
at the on-demand price, until something moves them. When a Ready Spot node of their pool
generation is free, this drains the on-demand workers one at a time through the lab's drain
(``drain.py``: cordon the on-demand node, evict the pod; the worker saves its last step on
SIGTERM and the group re-forms without losing a step), waits until the replacement has landed
on a Spot node and the group trains again at full size, makes the on-demand node schedulable
again (empty, the autoscaler removes it), and moves the next. It stops when no worker is left
on on-demand, or when no Spot node comes within a bound; ``--watch`` keeps at it until the job
ends. Each move is a fault of the run's report (kind ``move``), with what it saved.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from lab.azure.cluster.cloud_run import ENDED, at_full_size, open_job
from lab.azure.cluster.drain import cordon, evict
from lab.azure.cluster.follow import CloudOptions, JobFollower, wait_for, write_report
from lab.azure.cluster.gpu_nodes import Move, Stay, gpu_node, next_move, placements
from lab.azure.cluster.kube import Cluster, ClusterError, job_phase
from lab.live.event_log import LabEventLog
from lab.live.status_line import StatusLine
from lab.report.run_logs import REBALANCE_EVENTS
from training.elastic.exit_codes import OK, PERMANENT
from training.records import RESUMED

MOVED, STOPPED, FAILED = "moved", "stopped", "failed"


@dataclass
class RebalanceOptions:
    """How long each stage may take, and whether to keep at it for the whole run."""

    spot_timeout_s: float = 600.0
    """For a drained worker's replacement to land on a Spot node, and, after a move, for the
    next free Spot node to come."""
    ready_timeout_s: float = 600.0
    """For the job to train at full size before the first move."""
    recover_timeout_s: float = 1800.0
    """For the group to train at full size again after a move."""
    watch: bool = False
    """Keep moving workers back to Spot until the job ends (or Ctrl-C)."""
    poll_s: float = 30.0
    """How often to look again for a free Spot node while waiting."""


@dataclass
class _Run:
    """What every move of one rebalance shares."""

    cluster: Cluster
    follower: JobFollower
    log: LabEventLog
    plan: RebalanceOptions
    full: int
    per_node: int

    def decide(self) -> Move | Stay:
        return _decide(self.cluster)

    def say(self, text: str) -> None:
        self.follower.status.message(text)


def rebalance(
    options: CloudOptions,
    plan: RebalanceOptions,
    cluster: Cluster | None = None,
    status: StatusLine | None = None,
) -> int:
    """Move the job's on-demand workers to free Spot nodes, one at a time; write the report."""
    opened = open_job(options, "rebalance", cluster)
    if isinstance(opened, int):
        return opened
    cluster, full, per_node = opened
    try:
        first = _first_decision(cluster, plan)
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return PERMANENT
    if isinstance(first, Stay):
        print(f"nothing to move: {first.reason}")  # and nothing was touched
        return OK
    follower = JobFollower(cluster, options.out, status)
    run = _Run(cluster, follower, _log(options), plan, full, per_node)
    run.follower.start()
    outcome = OK
    try:
        if not at_full_size(run.follower, run.full, plan.ready_timeout_s, "rebalance"):
            return PERMANENT
        run.log.write("run_started", full_world_size=run.full, watch=plan.watch)
        outcome = _moves(run)
        run.log.write("run_ended")
    except KeyboardInterrupt:
        run.say("rebalance stopped; the job goes on")
        run.log.write("run_ended")
        outcome = PERMANENT
    except ClusterError as err:
        run.say(f"error: {err}")
        run.log.write("run_ended")
        outcome = PERMANENT
    finally:
        run.follower.close()
    report = write_report(options.out, options.prices)
    return outcome if report is not None else PERMANENT


def _log(options: CloudOptions) -> LabEventLog:
    return LabEventLog(options.out / REBALANCE_EVENTS)


def _decide(cluster: Cluster) -> Move | Stay:
    """The next move, from the GPU nodes and the job's pods as the API server lists them."""
    nodes = [n for n in map(gpu_node, cluster.gpu_nodes()) if n is not None]
    return next_move(nodes, placements(cluster.worker_pods()))


def _first_decision(cluster: Cluster, plan: RebalanceOptions) -> Move | Stay | None:
    """What to do now; None with ``--watch``, which waits for something to do."""
    return None if plan.watch else _decide(cluster)


def _moves(run: _Run) -> int:
    """Move workers until none is left on on-demand, no Spot node comes in time, or (with
    ``--watch``) the job ends."""
    index, waiting_since, said = 0, None, ""
    while True:
        try:
            decision = run.decide()
        except ClusterError as err:
            if not run.plan.watch:
                raise
            run.say(f"warning: {err}")  # for the length of a run, a refusal may pass
            wait_for(lambda: False, run.plan.poll_s, run.follower.tick)
            continue
        if isinstance(decision, Move):
            result = _move(run, index, decision)
            if result != MOVED:
                return OK if result == STOPPED else PERMANENT
            index, waiting_since, said = index + 1, None, ""
            continue
        if run.plan.watch:
            if job_phase(run.cluster.job()) in ENDED:
                run.say(f"the job ended; {index} worker(s) moved to Spot")
                return OK
        elif decision.done:
            run.say(f"done: {decision.reason}")
            return OK
        else:
            waiting_since = waiting_since or time.monotonic()
            if time.monotonic() - waiting_since > run.plan.spot_timeout_s:
                run.say(f"no Spot node came within {run.plan.spot_timeout_s:.0f} s: {said}")
                return OK
        if decision.reason != said:
            said = decision.reason
            run.say(f"waiting for a Spot node: {said}")
        wait_for(lambda: False, run.plan.poll_s, run.follower.tick)


def _move(run: _Run, index: int, move: Move) -> str:
    """One move: cordon, evict, the replacement on Spot, the group at full size again. The
    on-demand node is open again afterwards, whatever happened: empty, the autoscaler takes it
    away; when the move did not reach Spot, the worker may go back there."""
    before = {node for node in run.follower.recorder.pods.values() if node}
    run.say(f"moving {move.pod} off on-demand {move.node} to Spot (move {index + 1})")
    cordon(run.cluster, move.node)
    try:
        return _drained(run, index, move, before)
    finally:
        cordon(run.cluster, move.node, unschedulable=False)


def _drained(run: _Run, index: int, move: Move, before: set[str]) -> str:
    """Evict the worker of a cordoned on-demand node and follow it to Spot."""
    follower, plan = run.follower, run.plan
    injected_at = time.time()
    evict(run.cluster, move.pod)
    run.log.write(
        "fault_injected",
        index=index,
        kind="move",
        description=f"move {move.pod} to Spot",
        injected_at=injected_at,  # unrounded: the job may react within the millisecond
        planned_world_size=run.full,
        node=move.node,
        pod=move.pod,
    )
    mark = follower.mark()
    landed = _landed(run, before, plan.spot_timeout_s)
    if landed is None or not landed[2]:
        where = f"on {landed[1]}, not Spot" if landed else f"within {plan.spot_timeout_s:.0f} s"
        cordon(run.cluster, move.node, unschedulable=False)  # the worker may go back there
        run.log.write("move_abandoned", index=index, reason=f"no Spot node took it ({where})")
        run.say(f"no Spot node took {move.pod}'s replacement ({where}); {move.node} is open again")
        back = follower.trains_at(run.full, _after_regroup(run, mark), plan.recover_timeout_s)
        return STOPPED if back else FAILED
    pod, node, _ = landed
    run.log.write("worker_moved", index=index, pod=pod, node=node, from_node=move.node)
    if not follower.trains_at(run.full, _after_regroup(run, mark), plan.recover_timeout_s):
        run.say(f"the group did not train at full size again within {plan.recover_timeout_s:.0f} s")
        return FAILED
    run.say(f"{pod} trains on Spot node {node}")
    return MOVED


def _landed(run: _Run, before: set[str], timeout_s: float) -> tuple[str, str, bool] | None:
    """(pod, node, on Spot) of the worker placed on a node that held none at the move; None
    when none is placed in time."""
    found: list[tuple[str, str]] = []

    def placed() -> bool:
        pods = dict(run.follower.recorder.pods)
        found[:] = sorted((p, n) for p, n in pods.items() if n and n not in before)
        return bool(found)

    if not wait_for(placed, timeout_s, run.follower.tick):
        return None
    pod, node = found[0]
    nodes = {n.name: n for n in map(gpu_node, run.cluster.gpu_nodes()) if n is not None}
    return pod, node, node in nodes and nodes[node].spot


def _after_regroup(run: _Run, mark: int) -> int:
    """Where the group's new round begins: lines at full size before the drained worker's
    group re-formed do not count (its last ``resumed`` record after the move, once seen)."""
    timeout_s = run.plan.recover_timeout_s
    wait_for(lambda: _resumed_at_full(run, mark) is not None, timeout_s, run.follower.tick)
    return _resumed_at_full(run, mark) or mark


def _resumed_at_full(run: _Run, mark: int) -> int | None:
    records = run.follower.recorder.records
    rounds = [
        i
        for i in range(mark, len(records))
        if records[i].get("event") == RESUMED and records[i].get("world_size") == run.full
    ]
    return rounds[-1] if rounds else None
