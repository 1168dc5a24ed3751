"""A replacement's path, step by step, from an eviction to the first step at full size again:
the table ``lab drill`` prints and a cluster run's report carries.

Each step is read from the cluster's own records or the job's logs, never assumed:

- notice at the worker: the evicted worker's ``emergency_save`` (its SIGTERM), else a
  survivor's ``peer_failure``;
- pod deleted: the pod watch, the old pod's ``deletionTimestamp``; else the kubelet's
  ``Killing``;
- new pod Pending: the pod watch, the new pod's ``creationTimestamp``; else the scheduler's
  ``FailedScheduling``;
- node requested: the cluster autoscaler's ``TriggeredScaleUp`` on the pod;
- node Ready: the kubelet's ``NodeReady`` on the new node; else the node controller's
  ``RegisteredNode``;
- image pulled: the kubelet's ``Pulled`` on the pod;
- container started: the pod watch, the container's ``state.running.startedAt``; else the
  kubelet's ``Started``;
- joined: the job's logs, the new pod's ``started`` line (its worker in a rendezvous round);
- first step at full size: the job's logs, the first metrics line at the full world size
  after the join.

Event reasons as the components emit them: kubernetes ``pkg/kubelet/events/event.go``
(``Killing``, ``Pulled``, ``Started``, ``NodeReady``), ``pkg/controller/nodelifecycle``
(``RegisteredNode``), the scheduler's ``FailedScheduling``, and the cluster autoscaler's
``TriggeredScaleUp`` (``processors/status/eventing_scale_up_processor.go``). Events carry
whole seconds (``lastTimestamp``); the job's lines carry milliseconds.
"""

from __future__ import annotations

import math
from typing import Any

from lab.report.run_logs import RunLogs, parse_time
from training.records import EMERGENCY_SAVE, METRICS, PEER_FAILURE, STARTED

STEPS = (
    "eviction requested",
    "notice at the worker",
    "pod deleted",
    "new pod Pending",
    "node requested",
    "node Ready",
    "image pulled",
    "container started",
    "joined",
    "first step at full size",
)
_POD_REASONS = ("FailedScheduling", "TriggeredScaleUp", "Scheduled", "Pulling", "Pulled", "Started")


def pod_change(change: str, obj: dict[str, Any]) -> dict[str, Any]:
    """A pod (a plain API object) reduced to its lifecycle: the watch's change, its uid and
    node, and the API server's times (RFC 3339 text) of its creation, its deletion and its
    first container's start."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    running = [
        ((c.get("state") or {}).get("running") or {}).get("startedAt")
        for c in status.get("containerStatuses") or []
    ]
    started = sorted(str(t) for t in running if t)
    return {
        "change": change,
        "pod": meta.get("name"),
        "uid": meta.get("uid"),
        "node": (obj.get("spec") or {}).get("nodeName"),
        "phase": status.get("phase"),
        "created": meta.get("creationTimestamp"),
        "deleting": meta.get("deletionTimestamp"),
        "started": started[0] if started else None,
    }


def _time(text: Any) -> float | None:
    try:
        return parse_time(str(text)) if text else None
    except ValueError:
        return None


class _Path:
    """What one replacement's steps are read from: the run, the fault's window."""

    def __init__(self, run: RunLogs, origin: float, until: float) -> None:
        self.run = run
        self.origin = origin
        self.until = until
        # API times are whole seconds: a pod created 0.3 s after the request reads as before it.
        self.floor = math.floor(origin)

    def event(self, reasons: tuple[str, ...], name: str | None = None) -> tuple[float, str] | None:
        for e in self.run.cluster_events:
            wanted = e.reason in reasons and (name is None or e.name == name)
            if wanted and self.floor <= e.ts < self.until:
                return e.ts, f"event {e.reason} ({e.kind} {e.name})"
        return None

    def changes(self) -> list[dict[str, Any]]:
        return [c for c in self.run.pod_changes if self.floor <= c["ts"] < self.until]

    def record(self, pod: str | None, after: float, test: Any) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in self.run.records
                if max(after, self.origin) <= r["ts"] < self.until
                and (pod is None or r["node"] == pod)
                and test(r)
            ),
            None,
        )


def _deleted(path: _Path) -> tuple[float, str] | None:
    for change in path.changes():
        deleting = _time(change.get("deleting"))
        if deleting is not None and deleting >= path.floor:
            return deleting, f"pod watch: {change['pod']} deletionTimestamp"
    return path.event(("Killing",))


def _new_pod(path: _Path) -> tuple[str | None, tuple[float, str] | None]:
    """The replacement pod's name, and when it was created (Pending)."""
    for change in path.changes():
        created = _time(change.get("created"))
        if created is not None and created >= path.floor and not change.get("deleting"):
            return change["pod"], (created, f"pod watch: {change['pod']} creationTimestamp")
    for e in path.run.cluster_events:
        if path.floor <= e.ts < path.until and e.kind == "Pod" and e.reason in _POD_REASONS:
            pending = path.event(("FailedScheduling",), e.name)
            return e.name, pending
    return None, None


def _container_started(path: _Path, pod: str | None, after: float) -> tuple[float, str] | None:
    """The pod watch's start time, else the kubelet's event, else the new pod's first log
    line after ``after`` (its image pulled: the old pod of the same name logs until then)."""
    for change in path.changes():
        started = _time(change.get("started"))
        if change["pod"] == pod and started is not None and started >= path.floor:
            return started, f"pod watch: {pod} state.running.startedAt"
    event = path.event(("Started",), pod) if pod else None
    first = path.record(pod, after, lambda r: True) if event is None else None
    return (first["ts"], f"job log: {pod}'s first line") if first else event


def replacement_steps(
    run: RunLogs, fault: dict[str, Any], until: float = math.inf
) -> dict[str, Any] | None:
    """The steps of the replacement after ``fault`` (a report entry), up to ``until`` (the
    next loss); None when no replacement pod shows in the window."""
    origin = fault["injected_at"]
    path = _Path(run, origin, until)
    pod, pending = _new_pod(path)
    if pod is None:
        return None
    node = run.node_at(pod, until if math.isfinite(until) else math.inf)
    found: dict[str, tuple[float, str] | None] = {
        "eviction requested": (origin, f"the fault: {fault['description']}"),
        "notice at the worker": _notice(path),
        "pod deleted": _deleted(path),
        "new pod Pending": pending,
        "node requested": path.event(("TriggeredScaleUp",), pod),
        "node Ready": path.event(("NodeReady",), node) or path.event(("RegisteredNode",), node),
        "image pulled": path.event(("Pulled",), pod),
    }
    before = [found[k] for k in ("image pulled", "node Ready", "node requested") if found[k]]
    after_pull = before[0][0] if before else origin
    found["container started"] = _container_started(path, pod, after_pull)
    after = (found["container started"] or (origin, ""))[0]
    joined = path.record(pod, after, lambda r: r.get("event") == STARTED)
    found["joined"] = _from_log(joined, "started", pod)
    full = fault.get("world_size_before")
    first = path.record(
        None,
        joined["ts"] if joined else math.inf,
        lambda r: r["kind"] == METRICS and r["world_size"] == full,
    )
    found["first step at full size"] = _from_log(first, f"metrics at world {full}", None)
    return {"pod": pod, "node": node, "steps": _rows(found, origin)}


def _notice(path: _Path) -> tuple[float, str] | None:
    for event in (EMERGENCY_SAVE, PEER_FAILURE):
        record = path.record(None, path.origin, lambda r, e=event: r.get("event") == e)
        if record is not None:
            return record["ts"], f"job log: {record['node']} {event}"
    return None


def _from_log(
    record: dict[str, Any] | None, what: str, pod: str | None
) -> tuple[float, str] | None:
    if record is None:
        return None
    where = f"round {record['rdzv_round']}, " if record.get("rdzv_round") else ""
    world = f"world {record['world_size']}" if "world_size" in record else ""
    detail = f" ({where}{world})" if pod and (where or world) else ""
    return record["ts"], f"job log: {pod or record['node']} {what}{detail}"


def _rows(found: dict[str, tuple[float, str] | None], origin: float) -> list[dict[str, Any]]:
    rows, previous = [], origin
    for step in STEPS:
        seen = found.get(step)
        at = seen[0] if seen else None
        rows.append(
            {
                "step": step,
                "at": round(at, 3) if at is not None else None,
                "since_eviction_s": round(at - origin, 3) if at is not None else None,
                "since_previous_s": round(at - previous, 3) if at is not None else None,
                "source": seen[1] if seen else "not seen",
            }
        )
        previous = at if at is not None else previous
    return rows


def format_steps(fault: dict[str, Any]) -> str:
    """The table of one fault's replacement path, for the terminal."""
    path = fault["replacement_steps"]
    last = path["steps"][-1]["since_eviction_s"]
    total = "-, no step at full size within the run" if last is None else f"{last:.0f} s"
    lines = [
        f"fault {fault['index']}: replacement {path['pod']} on {path['node'] or '?'} in "
        f"{total} (eviction to the first step at full size), step by step:",
        f"  {'step':<24} {'since eviction':>14} {'step took':>9}  from",
    ]
    for row in path["steps"]:
        since = "-" if row["at"] is None else f"{row['since_eviction_s']:+.1f} s"
        took = "-" if row["at"] is None else f"{row['since_previous_s']:.1f} s"
        lines.append(f"  {row['step']:<24} {since:>14} {took:>9}  {row['source']}")
    return "\n".join(lines)
