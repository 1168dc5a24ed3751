"""A run's saved logs, from the local lab or from the cluster, in the one record format.

Two layouts, both read here and nowhere else:

- a local lab run (``lab-runs/<timestamp>/``): ``nodes/<node>.jsonl``, ``lab-events.jsonl``
  (the lab's injections) and ``scenario.json``;
- a cluster run (what ``lab watch`` and ``lab drill`` write, or what a user saved by hand):
  ``pods/<pod>.log`` (or ``<pod>.log``), each what ``kubectl logs --timestamps`` prints;
  optional Kubernetes events, ``events.jsonl`` (one Event object a line) or ``events.json``
  (``kubectl get events -o json``); optional ``drill-events.jsonl`` and
  ``rebalance-events.jsonl``, the evictions ``lab drill`` made and the moves ``lab rebalance``
  made. Without them the faults are inferred from the logs (``inferred_faults.py``);
  ``watch-events.jsonl`` then bounds the report to the span ``lab watch`` watched. Optional
  ``placements.jsonl``, the node each pod ran on, as the commands saw it (with the Scheduled
  events it tells Spot hours from on-demand ones).

Each worker pod (or lab node) logs the same JSON lines, so every record keeps its ``node``
tag: the pod's name on the cluster.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from lab.report.inferred_faults import infer_faults
from lab.report.node_logs import read_records
from training.records import METRICS, RESUMED, STARTED, Record, finite_number, parse

DRILL_EVENTS = "drill-events.jsonl"
"""What ``lab drill`` did: the span of the drill and each eviction (``fault_injected``)."""
PLACEMENTS = "placements.jsonl"
"""Where each worker pod was placed, as ``lab watch``, ``drill`` and ``rebalance`` saw it: one
``{"ts", "pod", "node"}`` a line (a pod recreated under its name gets a line per node)."""
POD_CHANGES = "pod-changes.jsonl"
"""Each new state of a worker pod as the commands' pod watch saw it (``pod_change``): when
the API server created it, deleted it, and its container started, on the cluster's clock."""
REBALANCE_EVENTS = "rebalance-events.jsonl"
"""What ``lab rebalance`` did: its span and each worker it moved from on-demand to Spot
(``fault_injected`` of kind ``move``, then ``worker_moved``)."""
WATCH_EVENTS = "watch-events.jsonl"
"""The span ``lab watch`` watched: its faults are inferred from the logs."""


class RunLogsError(ValueError):
    """The directory holds no run the report can read; the message says what it expects."""


@dataclass
class ClusterEvent:
    """A Kubernetes Event, reduced to what the report reads."""

    ts: float
    reason: str
    kind: str
    """The involved object's kind: Pod, Node, ..."""
    name: str
    message: str = ""


@dataclass
class RunLogs:
    """Everything a report is built from."""

    records: list[Record]
    injections: list[dict[str, Any]]
    start_ts: float
    end_ts: float | None
    max_steps: int
    global_batch_size: int
    planned_faults: int
    source: str
    """"lab" or "cluster"."""
    cluster_events: list[ClusterEvent] = field(default_factory=list)
    lab_events: list[dict[str, Any]] = field(default_factory=list)
    placements: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    """pod -> (when, node) of each placement, in time order (a cluster run's)."""
    pod_changes: list[dict[str, Any]] = field(default_factory=list)
    """The rows of ``POD_CHANGES``, in the order seen."""
    scenario: str | None = None
    """The scenario's name (a lab run's)."""

    def node_at(self, pod: str, ts: float) -> str | None:
        """The node ``pod`` ran on at ``ts``: its newest placement by then (None: unknown)."""
        placed = [node for when, node in self.placements.get(pod, []) if when <= ts]
        return placed[-1] if placed else None


# ---- what a record and a side file must hold ------------------------------------------------

_COUNTS = ("step", "world_size", "max_steps", "global_batch_size")
_RATES = ("loss", "samples_per_s")


def _count(value: Any) -> bool:
    return finite_number(value) and value == int(value) and value >= 0


def well_formed(record: Record) -> bool:
    """Whether a training record holds what the report and the status line read from it.

    A JSON line that only looks like a record (a count that is not a whole number, a metrics
    line without its step) is skipped like any other stray line, never fatal. A loss may be
    NaN: training that diverged logs it so.
    """
    if not finite_number(record.get("ts")):
        return False
    if any(key in record and not _count(record[key]) for key in _COUNTS):
        return False
    if any(record.get(key) is not None and not _rate(record[key]) for key in _RATES):
        return False
    if record["kind"] == METRICS:
        return "step" in record and "world_size" in record and _rate(record.get("loss"))
    event = record.get("event")
    return isinstance(event, str) and (event != RESUMED or "step" in record)


def _rate(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_side_file(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file the lab or ``lab watch``/``drill`` wrote beside
    the logs (lab-events.jsonl, drill-events.jsonl, events.jsonl); [] when absent.

    ``RunLogsError`` names the file and line of anything else; only a last line cut off
    mid-write (no newline after it) is dropped.
    """
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RunLogsError(f"{path}: cannot read it: {err}") from None
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif not (number == len(lines) and not text.endswith("\n")):
            raise RunLogsError(f"{path} line {number} is not a JSON object: {line[:60]!r}")
    return rows


_LAB_EVENT_FIELDS = {"event": str, "ts": float}
_FAULT_FIELDS = {"index": int, "kind": str, "injected_at": float}


def read_lab_events(path: Path) -> list[dict[str, Any]]:
    """What the lab, ``lab watch`` or ``lab drill`` recorded; ``RunLogsError`` for a record
    the report could not place (no event name or time, a fault without its fields)."""
    rows = read_side_file(path)
    for number, row in enumerate(rows, 1):
        fields = dict(_LAB_EVENT_FIELDS)
        if row.get("event") == "fault_injected":
            fields.update(_FAULT_FIELDS)
        for key, kind in fields.items():
            value = row.get(key)
            valid = {str: isinstance(value, str), int: _count(value), float: finite_number(value)}
            if not valid[kind]:
                raise RunLogsError(
                    f"{path}: record {number} has no valid {key!r}: {json.dumps(row)[:80]}"
                )
    return rows


# ---- the local lab --------------------------------------------------------------------------


def is_lab_run(directory: Path) -> bool:
    return (directory / "nodes").is_dir() and (directory / "lab-events.jsonl").exists()


def load_lab_run(directory: Path) -> RunLogs:
    """A ``lab run`` output directory."""
    lab_events = read_lab_events(directory / "lab-events.jsonl")
    started = [r["ts"] for r in lab_events if r["event"] == "run_started"]
    ended = [r["ts"] for r in lab_events if r["event"] == "run_ended"]
    try:
        scenario = json.loads((directory / "scenario.json").read_text())
        train = scenario["train"]
        max_steps, batch = int(train["max_steps"]), int(train["global_batch_size"])
        planned = len(scenario["faults"])
        name = scenario.get("name")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RunLogsError(f"{directory}/scenario.json is missing or unreadable: {err}") from None
    records = [r for r in read_records(directory / "nodes") if well_formed(r)]
    return RunLogs(
        records=records,
        injections=[r for r in lab_events if r["event"] == "fault_injected"],
        start_ts=started[0] if started else (records[0]["ts"] if records else 0.0),
        end_ts=ended[-1] if ended else None,
        max_steps=max_steps,
        global_batch_size=batch,
        planned_faults=planned,
        source="lab",
        lab_events=lab_events,
        scenario=name if isinstance(name, str) else None,
    )


# ---- the cluster ----------------------------------------------------------------------------

# kubectl logs --timestamps: an RFC 3339 time with nanoseconds, a space, then the line.
_STAMPED = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) (.*)$")


def parse_time(text: str) -> float:
    """An RFC 3339 time (Kubernetes writes nanoseconds and ``Z``) as a Unix timestamp."""
    match = re.match(r"^(.*?T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", text.strip())
    if not match:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    base, fraction, zone = match.groups()
    zone = "+00:00" if zone == "Z" else zone
    seconds = datetime.fromisoformat(base + zone).timestamp()
    return seconds + (float(fraction) if fraction else 0.0)


def parse_pod_log(text: str, pod: str) -> list[Record]:
    """The training records in one pod's ``kubectl logs --timestamps`` output."""
    records = []
    for line in text.splitlines():
        stamped = _STAMPED.match(line)
        record = parse(stamped.group(2) if stamped else line, pod)
        if record is not None and well_formed(record):
            records.append(record)
    return records


def pod_log_files(directory: Path) -> list[Path]:
    base = directory / "pods" if (directory / "pods").is_dir() else directory
    return sorted(base.glob("*.log"))


def cluster_event(obj: dict[str, Any]) -> ClusterEvent | None:
    """A core/v1 or events.k8s.io/v1 Event as a ``ClusterEvent`` (None without a time)."""
    stamp = (
        obj.get("lastTimestamp")
        or obj.get("eventTime")
        or obj.get("firstTimestamp")
        or (obj.get("series") or {}).get("lastObservedTime")
        or (obj.get("metadata") or {}).get("creationTimestamp")
    )
    if not stamp:
        return None
    involved = obj.get("involvedObject") or obj.get("regarding") or {}
    return ClusterEvent(
        ts=parse_time(stamp),
        reason=str(obj.get("reason", "")),
        kind=str(involved.get("kind", "")),
        name=str(involved.get("name", "")),
        message=str(obj.get("message") or obj.get("note") or ""),
    )


def read_cluster_events(directory: Path) -> list[ClusterEvent]:
    objects = [(directory / "events.jsonl", o) for o in read_side_file(directory / "events.jsonl")]
    listed = directory / "events.json"
    if listed.exists():
        try:
            items = json.loads(listed.read_text()).get("items", [])
        except (OSError, ValueError, AttributeError) as err:
            raise RunLogsError(f"{listed} is not an event list: {err}") from None
        if not isinstance(items, list) or not all(isinstance(o, dict) for o in items):
            raise RunLogsError(f"{listed} is not an event list: its items are not all objects")
        objects += [(listed, o) for o in items]
    events = []
    for path, obj in objects:
        try:
            event = cluster_event(obj)
        except (ValueError, AttributeError, TypeError) as err:
            raise RunLogsError(f"{path} holds an event the report cannot read: {err}") from None
        if event is not None:
            events.append(event)
    return sorted(events, key=lambda e: e.ts)


def read_placements(directory: Path, events: list[ClusterEvent]) -> dict[str, list]:
    """pod -> [(when, node)]: the recorded placements and the Scheduled events ("Successfully
    assigned <namespace>/<pod> to <node>"), in time order."""
    found = {(r.get("pod"), r.get("node"), r["ts"]) for r in _placed(directory / PLACEMENTS)}
    found |= {
        (e.name, e.message.rsplit(" to ", 1)[-1].strip(), e.ts)
        for e in events
        if e.kind == "Pod" and e.reason == "Scheduled" and " to " in e.message
    }
    placements: dict[str, list[tuple[float, str]]] = {}
    for pod, node, when in sorted(found, key=lambda placed: placed[2]):
        if isinstance(pod, str) and isinstance(node, str) and node:
            placements.setdefault(pod, []).append((float(when), node))
    return placements


def _placed(path: Path) -> list[dict[str, Any]]:
    rows = read_side_file(path)
    bad = next((r for r in rows if not finite_number(r.get("ts"))), None)
    if bad is not None:
        raise RunLogsError(f"{path}: a placement without a valid 'ts': {json.dumps(bad)[:80]}")
    return rows


def load_cluster_run(
    directory: Path, max_steps: int | None = None, global_batch_size: int | None = None
) -> RunLogs:
    """Pod logs, and the cluster's and the drill's events when saved beside them."""
    files = pod_log_files(directory)
    try:
        texts = {path.stem: path.read_text(errors="replace") for path in files}
    except OSError as err:
        raise RunLogsError(f"cannot read a pod log: {err}") from None
    records = sorted(
        (r for pod, text in texts.items() for r in parse_pod_log(text, pod)),
        key=lambda r: r["ts"],
    )
    if not records:
        raise RunLogsError(
            f"{directory} holds no training records: expected a lab run (nodes/*.jsonl and "
            "lab-events.jsonl) or pod logs (pods/<pod>.log or <pod>.log, as `kubectl logs "
            "--timestamps` prints them)"
        )
    started = [r for r in records if r.get("event") == STARTED]
    target = next((r for r in reversed(started) if "max_steps" in r), {})
    max_steps = max_steps or target.get("max_steps")
    batch = global_batch_size or target.get("global_batch_size")
    if not max_steps or not batch:
        raise RunLogsError(
            "the logs do not say the run's max_steps and global_batch_size (older images "
            "log neither): pass --max-steps and --global-batch-size"
        )
    acted = [read_lab_events(directory / name) for name in (DRILL_EVENTS, REBALANCE_EVENTS)]
    drill = sorted((r for rows in acted for r in rows), key=lambda r: r["ts"])
    span = drill or read_lab_events(directory / WATCH_EVENTS)
    events = read_cluster_events(directory)
    begun = [r["ts"] for r in span if r["event"] == "run_started"]
    ended = [r["ts"] for r in span if r["event"] == "run_ended"]
    start_ts = begun[0] if begun else records[0]["ts"]
    if drill:
        injections = [r for r in drill if r["event"] == "fault_injected"]
    else:
        injections = [f for f in infer_faults(records, events) if f["injected_at"] >= start_ts]
        for index, fault in enumerate(injections):
            fault["index"] = index
    return RunLogs(
        records=records,
        injections=injections,
        start_ts=start_ts,
        end_ts=ended[-1] if ended else None,
        max_steps=int(max_steps),
        global_batch_size=int(batch),
        planned_faults=len(injections),
        source="cluster",
        cluster_events=events,
        lab_events=span,
        placements=read_placements(directory, events),
        pod_changes=_placed(directory / POD_CHANGES),
    )


def load_run(directory: Path, **overrides: int | None) -> RunLogs:
    """Whichever layout ``directory`` has."""
    if not directory.is_dir():
        raise RunLogsError(f"{directory} is not a directory")
    if is_lab_run(directory):
        return load_lab_run(directory)
    return load_cluster_run(directory, **overrides)
