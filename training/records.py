"""The records the training program writes, one JSON object a line: the contract between the
trainer's ``EventLog`` (training/loop/metrics.py) and everything that reads its lines (the
lab's report and live view, the benchmarks, the tests).

A line's ``kind`` is ``metrics`` (rank 0's progress at each log step) or ``event`` (``event``
names which). Each kind and event has its fields below; the writer checks every line against
them (``check``), so a field or an event no reader has heard of fails the writer's tests. The
one reader is ``parse`` (a line) and ``read_lines`` (a log): lines that are not records, a
stray print or a last line cut off by SIGKILL, are skipped. Free of torch: the lab's tools
import it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NotRequired, TypedDict

METRICS = "metrics"
EVENT = "event"
KINDS = (METRICS, EVENT)

STARTED = "started"
READY = "ready"
RESUMED = "resumed"
SETTINGS_CHANGED = "settings_changed"
INITIALIZED = "initialized"
PERMIT_WAIT = "permit_wait"
STEP_COMPLETED = "step_completed"
EVALUATED = "evaluated"
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_FAILED = "checkpoint_failed"
EMERGENCY_SAVE = "emergency_save"
PEER_FAILURE = "peer_failure"
STORAGE_FAILURE = "storage_failure"
FINISHED = "finished"
RECORDS_DROPPED = "records_dropped"
DATA_WAITING = "data_waiting"
DATA_COPIED = "data_copied"

Record = dict[str, Any]
"""A record as read: one of the TypedDicts below, with the ``node`` whose log held it."""


class Line(TypedDict):
    """What every line carries. ``rank`` is null on an agent's lines; ``rdzv_round`` is the
    rendezvous round the worker trains in, when it knows it (two at once is split brain)."""

    ts: float
    kind: str
    rank: NotRequired[int | None]
    restart_count: NotRequired[int]
    run_id: NotRequired[str]
    rdzv_round: NotRequired[str]


class Metrics(Line):
    """Rank 0 at a log step: the window's global mean loss and rate."""

    step: int
    epoch: int
    world_size: int
    loss: float
    samples_per_s: float
    step_time_s: NotRequired[float]
    applied_ts: NotRequired[float]
    """When the last step was let through to apply: its permit held, right before its
    optimizer step (epoch seconds)."""


class Event(Line):
    event: str


class Started(Event):
    """Each worker at its start, with the run's target."""

    world_size: int
    local_rank: NotRequired[int]
    group_rank: NotRequired[int]
    max_steps: int
    task: str
    global_batch_size: int


class Ready(Event):
    """Rank 0, wrapped and about to train: how long its start took, phase by phase."""

    step: int
    seconds: float
    phases: dict[str, float]
    warm: bool


class Resumed(Event):
    """Rank 0, once the ranks agreed where to resume: a round's start."""

    step: int
    source: str
    from_rank: int
    lost_steps: int | None
    world_size: int
    seconds: float


class SettingsChanged(Event):
    step: int
    changed: dict[str, dict[str, Any]]


class Initialized(Event):
    """``--init-from``: the weights of another run's ``from_step``."""

    uri: str
    from_step: int


class PermitWait(Event):
    step: int
    lapsed_s: float


class StepCompleted(Event):
    """Every node but rank 0's at a log step, so a step is counted from each node's own log."""

    step: int
    world_size: int
    applied_ts: NotRequired[float]
    """As the metrics line's: when the step was let through to apply."""


class Evaluated(Event):
    step: int
    world_size: int
    eval_loss: float
    sample: NotRequired[str]


class CheckpointSaved(Event):
    step: int
    bytes: int
    seconds: float
    stall_s: float
    name: str


class CheckpointFailed(Event):
    step: int
    error: str
    failures_in_a_row: int
    durable_step: int
    lag_steps: int | None


class EmergencySave(Event):
    """A node's save of its last completed step before its worker exits (``reason``: sigterm,
    peer_failure, storage_failure; ``leftover`` and ``agent`` for an older save made durable
    at a stop)."""

    step: int
    reason: str
    durable: bool
    seconds: NotRequired[float]
    local: NotRequired[bool]
    deadline_s: NotRequired[float | None]
    gave_up: NotRequired[str | None]
    local_s: NotRequired[float]
    durable_s: NotRequired[float]


class Failure(Event):
    """``peer_failure`` or ``storage_failure``: what stopped the round."""

    step: int
    error: str


class Finished(Event):
    step: int
    loss: float | None
    eval_loss: NotRequired[float | None]


class RecordsDropped(Event):
    """Lines the run's stored records could not keep while the store failed."""

    lines: int


class DataWaiting(Event):
    uri: str
    why: str
    waited_s: float
    hint: str


class DataCopied(Event):
    uri: str
    files: int
    copied: int
    bytes_read: int
    seconds: float


EVENTS: dict[str, type[Event]] = {
    STARTED: Started,
    READY: Ready,
    RESUMED: Resumed,
    SETTINGS_CHANGED: SettingsChanged,
    INITIALIZED: Initialized,
    PERMIT_WAIT: PermitWait,
    STEP_COMPLETED: StepCompleted,
    EVALUATED: Evaluated,
    CHECKPOINT_SAVED: CheckpointSaved,
    CHECKPOINT_FAILED: CheckpointFailed,
    EMERGENCY_SAVE: EmergencySave,
    PEER_FAILURE: Failure,
    STORAGE_FAILURE: Failure,
    FINISHED: Finished,
    RECORDS_DROPPED: RecordsDropped,
    DATA_WAITING: DataWaiting,
    DATA_COPIED: DataCopied,
}


def _fields(kind: type) -> frozenset[str]:
    return frozenset(kind.__required_keys__ | kind.__optional_keys__)  # type: ignore[attr-defined]


FIELDS: dict[str, frozenset[str]] = {name: _fields(kind) for name, kind in EVENTS.items()}
"""Each event's fields, by name."""
METRICS_FIELDS = _fields(Metrics)

COMPLETED = (CHECKPOINT_SAVED, EMERGENCY_SAVE, STEP_COMPLETED)
"""Events that show their ``step`` completed, beside the metrics lines."""
ACKNOWLEDGED = (CHECKPOINT_SAVED, FINISHED)
"""Events that say their ``step`` is durable (and an ``emergency_save`` that says so)."""


class RecordError(ValueError):
    """A line the contract does not know: an unknown kind or event, or a field it lacks."""


def check(record: dict[str, Any]) -> None:
    """Raise RecordError unless ``record`` is a kind or event of the contract with only its
    fields: a set comparison, cheap enough for every line."""
    kind = record.get("kind")
    if kind == METRICS:
        known = METRICS_FIELDS
    elif kind == EVENT:
        name = record.get("event")
        if name not in FIELDS:
            raise RecordError(f"event {name!r} is not in training/records.py")
        known = FIELDS[name]
    else:
        raise RecordError(f"record kind {kind!r} is not one of {', '.join(KINDS)}")
    if extra := record.keys() - known:
        what = kind if kind == METRICS else record["event"]
        raise RecordError(
            f"{what} record has fields {sorted(extra)} that training/records.py lacks"
        )


def parse(line: str, node: str | None = None) -> Record | None:
    """The record on ``line`` (tagged with the ``node`` whose log held it, if given), or None
    when the line is not one: not a JSON object, cut off, of no known kind, with no time."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        return None
    if not isinstance(record.get("ts"), int | float):
        return None
    return record if node is None else {**record, "node": node}


def read_lines(text: str, node: str | None = None) -> list[Record]:
    """Every record in a JSON-lines log, in the log's order; a torn last line is skipped."""
    return [r for line in text.splitlines() if (r := parse(line, node)) is not None]


def read_log(path: Path, node: str | None = None) -> list[Record]:
    """Every record in the log file ``path`` (none when there is no file yet)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return read_lines(text, node)


def is_event(record: Record, *names: str) -> bool:
    """Whether ``record`` is one of the events ``names``."""
    return record.get("kind") == EVENT and record.get("event") in names


def events_named(records: list[Record], name: str) -> list[Record]:
    """The ``name`` events of ``records``, in their order."""
    return [r for r in records if is_event(r, name)]


def metrics_lines(records: list[Record]) -> list[Record]:
    """The metrics lines of ``records``, in their order."""
    return [r for r in records if r.get("kind") == METRICS]


def trained_step(record: Record) -> int | None:
    """The step a log step's line says was trained (rank 0's metrics, every other node's
    ``step_completed``), or None."""
    if record.get("kind") == METRICS or is_event(record, STEP_COMPLETED):
        return int(record["step"])
    return None


def completed_step(record: Record) -> int | None:
    """The step ``record`` shows completed (a trained step, or a node's save of one), or None
    when it shows none."""
    if trained_step(record) is not None or is_event(record, *COMPLETED):
        return int(record["step"])
    return None


def acknowledged_step(record: Record) -> int | None:
    """The step ``record`` says is durable (a commit, the final save, a durable emergency
    save), or None."""
    if is_event(record, *ACKNOWLEDGED) or (
        is_event(record, EMERGENCY_SAVE) and record.get("durable")
    ):
        return int(record["step"])
    return None


def finite_number(value: Any) -> bool:
    """A finite JSON number (a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
