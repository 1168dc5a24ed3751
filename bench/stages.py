"""Where the time of one recovery goes, read from the node logs.

fault -> detected (the first ``peer_failure``; a worker stopped by its agent logs an
``emergency_save`` instead) -> worker spawned (``ready.ts - ready.seconds``: the ready
event counts from the process start) -> ready (``phases``: spawn and import, inputs,
process group, build, restore, DDP) -> first step (the recovery's first metrics line).

The four stages add up to the downtime. ``rendezvous_s`` is everything between detection
and the new worker's process start: the old worker's exit, the agent noticing it, the dead
node's heartbeat expiring, the last call and the agent spawning workers.

``paused_s`` is how long training stood still: from the last step at the old world size to
the first at the new one. For a lost node it is about the downtime; for a join the old group
goes on training while the new node boots, so it is much shorter than the downtime.
"""

from __future__ import annotations

from typing import Any

from training.records import EMERGENCY_SAVE, METRICS, PEER_FAILURE, READY, Record

STAGES = ("detect_s", "rendezvous_s", "startup_s", "first_step_s")
PHASES = (
    "spawn_and_import_s",
    "inputs_s",
    "process_group_s",
    "build_s",
    "restore_s",
    "resume_check_s",
    "ddp_s",
)


def _first_event(
    records: list[Record], names: tuple[str, ...], start: float, end: float
) -> Record | None:
    for record in records:
        if start <= record["ts"] <= end and record.get("event") in names:
            return record
    return None


def detected_at(records: list[Record], injected_at: float, end: float) -> float | None:
    """The first ``peer_failure`` after the fault, else the first ``emergency_save``."""
    for names in ((PEER_FAILURE,), (EMERGENCY_SAVE,)):
        record = _first_event(records, names, injected_at, end)
        if record is not None:
            return float(record["ts"])
    return None


def recovery_stages(fault: dict[str, Any], records: list[Record]) -> dict[str, Any] | None:
    """The stages of one recovered fault (see the module docstring); None if it did not recover.

    ``fault`` is an entry of the lab report's ``faults``; ``records`` are the node logs'
    records, ordered by time.
    """
    injected, recovered = fault["injected_at"], fault["recovered_at"]
    if not fault["recovered"] or recovered is None or fault["resumed_at"] is None:
        return None
    ready = _first_event(records, (READY,), fault["resumed_at"], recovered)
    if ready is None:
        return None
    spawned = float(ready["ts"]) - float(ready["seconds"])
    detected = detected_at(records, injected, recovered)
    phases = ready.get("phases", {})
    return {
        "detect_s": _seconds(detected - injected) if detected is not None else None,
        "rendezvous_s": _seconds(spawned - (detected if detected is not None else injected)),
        "startup_s": _seconds(float(ready["seconds"])),
        "first_step_s": _seconds(recovered - float(ready["ts"])),
        "total_s": _seconds(recovered - injected),
        "paused_s": _paused(records, fault["world_size_before"], fault["resumed_at"], recovered),
        "phases": {name: float(phases[name]) for name in PHASES if name in phases},
    }


def _paused(records: list[Record], world_before: int, resumed_at: float, recovered: float) -> float:
    """Seconds from the last step at ``world_before`` (before the round resumed) to recovery."""
    steps = [
        float(r["ts"])
        for r in records
        if r["kind"] == METRICS and r["world_size"] == world_before and r["ts"] < resumed_at
    ]
    return _seconds(recovered - max(steps)) if steps else _seconds(recovered - resumed_at)


def _seconds(value: float) -> float:
    return round(value, 3)
