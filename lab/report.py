"""The lab's report: what each fault cost, computed from the node logs alone.

For every injected fault, with all times taken from the records' ``ts`` (one clock: one
machine):

- ``injected_at``: when the lab sent the signal (or stopped etcd).
- ``detected_at``: the first ``peer_failure`` or ``emergency_save`` after the injection,
  i.e. the first sign that a worker reacted. None when no worker survived to react
  (``kill-all``) or none had to (an etcd blip the agents rode out).
- ``resumed_at``: the ``resumed`` event of the round that went on to train.
- ``recovered_at``: the first metrics line after that ``resumed`` event: training runs
  again, at the new world size. For a fault that restarted no worker, the first metrics
  line after the injection.
- ``downtime_s`` = ``recovered_at - injected_at``: from the fault to training again.
  The time to the first line is part of it, so the lab logs every step.
- ``steps_lost`` = ``last_step_before - resumed_step``, where ``last_step_before`` is the
  highest completed step any record (metrics, checkpoint_saved, emergency_save) showed
  between the previous fault's recovery and this resume.
- ``world_size_before`` / ``world_size_after``: of the last metrics line before the
  injection and of the recovery line.
"""

from __future__ import annotations

import math
from typing import Any

from lab.node_logs import Record

_STEP_RECORDS = ("checkpoint_saved", "emergency_save")


def _events(records: list[Record], name: str, start: float, end: float) -> list[Record]:
    return [
        r
        for r in records
        if r["kind"] == "event" and r.get("event") == name and start <= r["ts"] < end
    ]


def _metrics(records: list[Record], start: float, end: float) -> list[Record]:
    return [r for r in records if r["kind"] == "metrics" and start <= r["ts"] < end]


def _recovery(
    records: list[Record], injected_at: float, end: float
) -> tuple[Record | None, Record | None]:
    """(the resumed event of the round that trained, its first metrics line)."""
    resumed: Record | None = None
    for record in records:
        if not injected_at <= record["ts"] < end:
            continue
        if record["kind"] == "event" and record.get("event") == "resumed":
            resumed = record
        elif record["kind"] == "metrics" and resumed is not None:
            return resumed, record
    return None, None


def _last_step(records: list[Record], start: float, end: float) -> int | None:
    steps = [
        int(r["step"])
        for r in records
        if start <= r["ts"] < end and (r["kind"] == "metrics" or r.get("event") in _STEP_RECORDS)
    ]
    return max(steps) if steps else None


def fault_outcome(
    records: list[Record], injection: dict[str, Any], window_start: float, window_end: float
) -> dict[str, Any]:
    """The report entry for one injected fault (see the module docstring)."""
    injected_at = float(injection["injected_at"])
    before = _metrics(records, -math.inf, injected_at)
    resumed, recovery = _recovery(records, injected_at, window_end)
    if recovery is None:  # no worker restarted: the next line after the fault
        later = _metrics(records, injected_at, window_end)
        recovery = later[0] if later else None
    reacted = sorted(
        _events(records, "peer_failure", injected_at, window_end)
        + _events(records, "emergency_save", injected_at, window_end),
        key=lambda r: r["ts"],
    )
    detected_at = reacted[0]["ts"] if reacted else None
    resumed_at = resumed["ts"] if resumed else None
    last_step = _last_step(records, window_start, resumed_at or injected_at)
    resumed_step = int(resumed["step"]) if resumed else None
    planned = injection.get("planned_world_size")
    after = recovery["world_size"] if recovery else None
    return {
        "index": injection["index"],
        "kind": injection["kind"],
        "description": injection.get("description", injection["kind"]),
        "injected_at": injected_at,
        "detected_at": detected_at,
        "resumed_at": resumed_at,
        "recovered_at": recovery["ts"] if recovery else None,
        "detection_s": _since(detected_at, injected_at),
        "resume_s": _since(resumed_at, injected_at),
        "downtime_s": _since(recovery["ts"] if recovery else None, injected_at),
        "world_size_before": before[-1]["world_size"] if before else None,
        "world_size_after": after,
        "planned_world_size": planned,
        "last_step_before": last_step,
        "resumed_step": resumed_step,
        "steps_lost": (
            last_step - resumed_step if last_step is not None and resumed_step is not None else None
        ),
        "reported_lost_steps": resumed.get("lost_steps") if resumed else None,
        "resume_source": resumed.get("source") if resumed else None,
        "recovered": recovery is not None and (planned is None or after == planned),
    }


def _since(ts: float | None, origin: float) -> float | None:
    return round(ts - origin, 3) if ts is not None else None


def build_report(
    records: list[Record],
    injections: list[dict[str, Any]],
    *,
    start_ts: float,
    global_batch_size: int,
    max_steps: int,
    planned_faults: int,
) -> dict[str, Any]:
    """The whole report: one entry per injected fault, plus totals for the run."""
    faults: list[dict[str, Any]] = []
    window_start = -math.inf
    ordered = sorted(injections, key=lambda i: i["injected_at"])
    for position, injection in enumerate(ordered):
        end = ordered[position + 1]["injected_at"] if position + 1 < len(ordered) else math.inf
        outcome = fault_outcome(records, injection, window_start, end)
        faults.append(outcome)
        window_start = outcome["recovered_at"] or injection["injected_at"]
    return {
        "start_ts": start_ts,
        "faults": faults,
        "run": _run_totals(records, faults, start_ts, global_batch_size, max_steps, planned_faults),
    }


def _run_totals(
    records: list[Record],
    faults: list[dict[str, Any]],
    start_ts: float,
    global_batch_size: int,
    max_steps: int,
    planned_faults: int,
) -> dict[str, Any]:
    metrics = [r for r in records if r["kind"] == "metrics"]
    finished = [r for r in records if r.get("event") == "finished"]
    end_ts = finished[-1]["ts"] if finished else (records[-1]["ts"] if records else start_ts)
    wall_s = max(end_ts - start_ts, 1e-9)
    final_step = int(finished[-1]["step"]) if finished else (metrics[-1]["step"] if metrics else 0)
    rates = [float(r["samples_per_s"]) for r in metrics]
    return {
        "finished": bool(finished) and final_step >= max_steps,
        "final_step": final_step,
        "max_steps": max_steps,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "wall_s": round(wall_s, 3),
        # Useful work over the whole run, downtime included.
        "samples_per_s": round(final_step * global_batch_size / wall_s, 2),
        # While training: the mean of the logged rates.
        "training_samples_per_s": round(sum(rates) / len(rates), 2) if rates else None,
        "total_downtime_s": round(sum(f["downtime_s"] or 0.0 for f in faults), 3),
        "faults_planned": planned_faults,
        "faults_injected": len(faults),
        "faults_recovered": sum(1 for f in faults if f["recovered"]),
        "all_recovered": len(faults) == planned_faults and all(f["recovered"] for f in faults),
    }


def _cell(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def format_table(report: dict[str, Any]) -> str:
    """The report as a fixed-width table for the terminal."""
    start = report["start_ts"]
    header = (
        f"{'#':>2}  {'fault':<34} {'at':>7} {'detect':>7} {'resume':>7} "
        f"{'down s':>7} {'lost':>5} {'world':>6} {'source':<8} ok"
    )
    lines = [header, "-" * len(header)]
    for f in report["faults"]:
        lines.append(
            f"{f['index']:>2}  {f['description'][:34]:<34} "
            f"{_cell(f['injected_at'] - start, '{:.1f}'):>7} "
            f"{_cell(f['detection_s'], '+{:.1f}'):>7} "
            f"{_cell(f['resume_s'], '+{:.1f}'):>7} "
            f"{_cell(f['downtime_s'], '{:.1f}'):>7} {_cell(f['steps_lost']):>5} "
            f"{_cell(f['world_size_before'])}->{_cell(f['world_size_after']):<3} "
            f"{_cell(f['resume_source']):<8} {'yes' if f['recovered'] else 'NO'}"
        )
    run = report["run"]
    lines.append("-" * len(header))
    lines.append(
        f"step {run['final_step']}/{run['max_steps']}, final loss {_cell(run['final_loss'])}, "
        f"{run['samples_per_s']} samples/s overall "
        f"({_cell(run['training_samples_per_s'])} while training), "
        f"{run['total_downtime_s']:.1f} s down in {run['wall_s']:.0f} s, "
        f"{run['faults_recovered']}/{run['faults_planned']} faults recovered"
    )
    return "\n".join(lines)
