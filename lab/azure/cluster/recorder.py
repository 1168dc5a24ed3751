"""What ``lab watch``, ``lab drill`` and ``lab rebalance`` see, turned into records and written
down as it arrives.

Each pod's log lines, each cluster event and each pod's placement on a node go to the run
directory in the layout ``lab.report.run_logs`` reads (``pods/<pod>.log`` as ``kubectl logs
--timestamps`` prints it, ``events.jsonl``, ``placements.jsonl``), so the commands and ``lab
report --logs`` build one report the same way. The training's records also feed the live
picture of the job and the status line; the autoscaler's capacity events become lines that
stay (``capacity_lines.py``).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.azure.cluster.capacity_lines import CapacityLines
from lab.azure.cluster.event_lines import event_line
from lab.azure.cluster.mount_failures import MountFailures
from lab.live.job_view import JobView
from lab.report.replacement import pod_change
from lab.report.run_logs import PLACEMENTS, POD_CHANGES, ClusterEvent, cluster_event, well_formed
from training.records import parse


@dataclass
class Recorder:
    """Everything seen, written to the run directory as it arrives, and the live picture."""

    out: Path
    view: JobView = field(default_factory=JobView)
    pods: dict[str, str] = field(default_factory=dict)
    """pod -> node."""
    last_cluster_event: str = "-"
    records: list[dict[str, Any]] = field(default_factory=list)
    mounts: MountFailures | None = None
    """Turns the job's FailedMount events into lines with the fix."""
    capacity: CapacityLines = field(default_factory=CapacityLines)
    """The autoscaler's capacity events, as lines that stay on screen (``said``)."""
    _said: list[str] = field(default_factory=list)
    _seen: dict[str, set[str]] = field(default_factory=dict)
    _newest: float = 0.0
    _events_seen: set[str] = field(default_factory=set)
    _placed: set[tuple[str, str]] = field(default_factory=set)
    _changes: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        (self.out / "pods").mkdir(parents=True, exist_ok=True)

    def place(self, pod: str, node: str | None) -> None:
        """A pod's node as the pod watch saw it; each new (pod, node) is written down once."""
        with self._lock:
            self.pods[pod] = node or ""
            if node and (pod, node) not in self._placed:
                self._placed.add((pod, node))
                row = {"ts": round(time.time(), 3), "pod": pod, "node": node}
                with open(self.out / PLACEMENTS, "a") as handle:
                    handle.write(json.dumps(row) + "\n")

    def pod_changed(self, change: str, obj: dict[str, Any]) -> None:
        """A worker pod as the pod watch saw it (a plain API object): each new state of its
        lifecycle (created, placed, container started, deleted) is written down once, for the
        drill's table of a replacement's steps."""
        row = pod_change(change, obj)
        key = json.dumps(row, sort_keys=True)
        with self._lock:
            if key in self._changes:
                return
            self._changes.add(key)
            with open(self.out / POD_CHANGES, "a") as handle:
                handle.write(json.dumps({"ts": round(time.time(), 3), **row}) + "\n")

    def log_line(self, pod: str, line: str) -> bool:
        """Keep one line of a pod's log unless a reconnect delivered it before."""
        line = line.rstrip("\n")
        with self._lock:
            seen = self._seen.setdefault(pod, set())
            if not line or line in seen:
                return False
            seen.add(line)
            with open(self.out / "pods" / f"{pod}.log", "a") as handle:
                handle.write(line + "\n")
            stamped = line.split(" ", 1)
            record = parse(stamped[-1], pod)
            if record is not None and well_formed(record):
                self.records.append(record)
                # Each pod's log streams on its own: the picture follows the newest record.
                if record["ts"] >= self._newest:
                    self._newest = record["ts"]
                    self.view.observe(record)
        return True

    def cluster_event(self, obj: dict[str, Any]) -> ClusterEvent | None:
        """Keep an Event once: a new watch lists every existing one again."""
        meta = obj.get("metadata") or {}
        identity = ("namespace", "name", "resourceVersion")
        key = json.dumps(
            [meta.get(k) for k in identity] + [obj.get(k) for k in ("count", "lastTimestamp")]
        )
        event = cluster_event(obj)
        with self._lock:
            if key in self._events_seen:
                return None
            self._events_seen.add(key)
            with open(self.out / "events.jsonl", "a") as handle:
                handle.write(json.dumps(obj) + "\n")
            said = self.capacity.line(event) if event is not None else None
            if said is not None:
                self._said.append(said)
            line = said or (event_line(event) if event is not None else None)
            if line is not None:
                self.last_cluster_event = line
            failed = self.mounts.line(event) if self.mounts and event else None
            if failed is not None:
                self._said.append(f"warning: {failed}")
        return event

    def said(self) -> list[str]:
        """Lines that must stay on screen, since the last call, each once: the autoscaler's
        capacity events and a pod's volume that fails to mount (the status line prints them)."""
        with self._lock:
            taken, self._said = self._said, []
        return taken

    def status(self, phase: str, max_steps: int | None) -> str:
        view = self.view
        loss = "-" if view.loss is None else f"{view.loss:.4f}"
        pods = ", ".join(f"{p}@{n or '?'}" for p, n in sorted(self.pods.items())) or "no pods"
        rate = next(
            (f"{r['samples_per_s']:.0f}" for r in reversed(self.records) if "samples_per_s" in r),
            "-",
        )
        return (
            f"{phase} | {pods} | world {view.world_size} | step {view.step}/{max_steps or '?'} | "
            f"loss {loss} | {rate} samples/s | {view.last_event} | {self.last_cluster_event}"
        )
