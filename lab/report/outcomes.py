"""The lab's report: what each fault cost, computed from the node logs alone.

For every injected fault, with all times taken from the records' ``ts`` (one clock: one
machine):

- ``injected_at``: when the lab sent the signal (or stopped etcd).
- ``detected_at``: the first ``peer_failure`` or ``emergency_save`` after the injection,
  i.e. the first sign that a worker reacted. None when no worker survived to react
  (``kill-all``) or none had to (an etcd blip the agents rode out).
- ``rounds``: every round that resumed after the injection, up to the recovery, with its
  world size and whether it trained. More than one when, say, a round of one node formed
  before the second new node had joined.
- ``recovered_at``: the first metrics line at the planned world size after the fault:
  training runs again, at the size the scenario planned. When a round resumed after the
  injection, the line must come after the first such round (earlier lines are the old
  round's); when none did (the agents rode an etcd restart out), any line counts.
- ``resumed_at``: the ``resumed`` event of the round that trained at the planned size
  (``resumed_step``, ``resume_source`` and ``reported_lost_steps`` are that round's).
- ``downtime_s`` = ``recovered_at - injected_at``: from the fault to training again.
  The time to the first line is part of it, so the lab logs every step.
- ``detect_to_resume_s`` = ``resume_s - detection_s``: from the first reaction to the round
  that trained, mostly the rendezvous.
- ``last_step_before``: the highest step any record showed completed (metrics, a save, a
  node's ``step_completed``: ``training.records.completed_step``) between the previous
  fault's recovery and the first resume.
- ``steps_lost``: steps trained again, over every round: for one round,
  ``last_step_before - resumed_step``.
- ``world_size_before`` / ``world_size_after``: of the last metrics line before the
  injection and of the recovery line (without recovery: of the window's last line).
- ``paused``: the intervals in which no optimiser step ran, from the injection to the
  recovery: gaps between metrics lines longer than the run's ``pause_after_s``, the first one
  clamped to the injection. A join pauses only while the group re-forms, not while the new
  node boots and the old group trains on; ``paused_s`` is their sum.
- ``two_groups``: two rendezvous rounds that trained at the same time (split brain), from
  the ``rdzv_round`` every worker's lines carry: a round trains from its first metrics line to
  its last, and no two such spans may overlap. A fault with one has not recovered.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from training.records import (
    EMERGENCY_SAVE,
    EVALUATED,
    EVENT,
    FINISHED,
    METRICS,
    PEER_FAILURE,
    RESUMED,
    STEP_COMPLETED,
    Record,
    completed_step,
    finite_number,
    is_event,
)

# A gap between metrics lines counts as a pause when it is this many typical gaps long (the
# program logs every ``log_every`` steps), and at least MIN_PAUSE_S.
PAUSE_FACTOR = 3.0
MIN_PAUSE_S = 1.0


def pause_after_s(records: list[Record]) -> float:
    """How long a gap between metrics lines must be to count as a pause in this run."""
    times = [r["ts"] for r in records if r["kind"] == METRICS]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > a]
    typical = statistics.median(gaps) if gaps else 0.0
    return max(PAUSE_FACTOR * typical, MIN_PAUSE_S)


def paused_intervals(
    records: list[Record], injected_at: float, until: float, after_s: float
) -> list[list[float]]:
    """[start, end] of every stretch without an optimiser step between ``injected_at`` and
    ``until`` (see the module docstring)."""
    times = sorted(r["ts"] for r in records if r["kind"] == METRICS)
    before = [t for t in times if t <= injected_at]
    marks = ([before[-1]] if before else [injected_at]) + [
        t for t in times if injected_at < t <= until
    ]
    if not math.isinf(until) and (not marks or marks[-1] < until):
        marks.append(until)  # no line yet at the end of the window: paused up to there
    paused = []
    for start, end in zip(marks, marks[1:], strict=False):
        start = max(start, injected_at)
        if end - start > after_s:
            paused.append([round(start, 3), round(end, 3)])
    return paused


def groups_at_once(records: list[Record]) -> list[dict[str, Any]]:
    """Every pair of rendezvous rounds whose groups trained at the same time.

    A round's members left the round before (their workers stopped), so its last step comes
    before the next round's first on one clock; an overlap is a second group training. Every
    node's own step log counts (rank 0's metrics, the others' ``step_completed``), and a step
    counts when it was let through to apply (``applied_ts``), not when its line was written:
    a node frozen inside its log write writes the line after its thaw.
    """
    spans: dict[int, list[float]] = {}
    for r in records:
        if (r["kind"] == METRICS or is_event(r, STEP_COMPLETED)) and r.get("rdzv_round"):
            at = r.get("applied_ts") or r["ts"]
            span = spans.setdefault(int(r["rdzv_round"]), [at, at])
            span[0], span[1] = min(span[0], at), max(span[1], at)
    ordered = sorted(spans.items(), key=lambda item: item[1][0])
    found = []
    for i, (first, (_, first_end)) in enumerate(ordered):
        for second, (second_start, second_end) in ordered[i + 1 :]:
            if second_start < first_end:
                found.append(
                    {
                        "rounds": [first, second],
                        "from": second_start,
                        "until": min(first_end, second_end),
                    }
                )
    return found


def _events(records: list[Record], name: str, start: float, end: float) -> list[Record]:
    return [
        r
        for r in records
        if r["kind"] == EVENT and r.get("event") == name and start <= r["ts"] < end
    ]


def _metrics(records: list[Record], start: float, end: float) -> list[Record]:
    return [r for r in records if r["kind"] == METRICS and start <= r["ts"] < end]


def _recovery_line(
    records: list[Record], rounds: list[Record], injected_at: float, end: float, planned: Any
) -> Record | None:
    """The first metrics line at the planned world size (see the module docstring)."""
    start = rounds[0]["ts"] if rounds else injected_at
    for line in _metrics(records, start, end):
        if planned is None or line["world_size"] == planned:
            return line
    return None


def _last_step(records: list[Record], start: float, end: float) -> int | None:
    steps = [
        step for r in records if start <= r["ts"] < end and (step := completed_step(r)) is not None
    ]
    return max(steps) if steps else None


def _steps_lost(
    records: list[Record], rounds: list[Record], window_start: float
) -> tuple[int | None, int | None]:
    """(last step before the first round, steps trained again over every round)."""
    lost, first_progress = 0, None
    start, previous = window_start, None
    for position, round_ in enumerate(rounds):
        seen = [s for s in (_last_step(records, start, round_["ts"]), previous) if s is not None]
        if not seen:
            return None, None
        progress = max(seen)
        first_progress = progress if position == 0 else first_progress
        lost += max(progress - int(round_["step"]), 0)
        start, previous = round_["ts"], int(round_["step"])
    return first_progress, lost


def _round_entries(records: list[Record], rounds: list[Record], end: float) -> list[dict[str, Any]]:
    entries = []
    for position, round_ in enumerate(rounds):
        until = rounds[position + 1]["ts"] if position + 1 < len(rounds) else end
        entries.append(
            {
                "resumed_at": round_["ts"],
                "world_size": round_.get("world_size"),
                "step": round_.get("step"),
                "source": round_.get("source"),
                "trained": bool(_metrics(records, round_["ts"], until)),
            }
        )
    return entries


def _sum_known(values: list[Any]) -> int | None:
    known = [int(v) for v in values if v is not None]
    return sum(known) if known else None


def fault_outcome(
    records: list[Record],
    injection: dict[str, Any],
    window_start: float,
    window_end: float,
    pause_after: float | None = None,
) -> dict[str, Any]:
    """The report entry for one injected fault (see the module docstring)."""
    injected_at = float(injection["injected_at"])
    pause_after = pause_after_s(records) if pause_after is None else pause_after
    planned = injection.get("planned_world_size")
    before = _metrics(records, -math.inf, injected_at)
    all_rounds = _events(records, RESUMED, injected_at, window_end)
    recovery = _recovery_line(records, all_rounds, injected_at, window_end, planned)
    recovered_at = recovery["ts"] if recovery else None
    rounds = [r for r in all_rounds if recovered_at is None or r["ts"] < recovered_at]
    final = rounds[-1] if rounds else None
    if rounds:
        last_step, steps_lost = _steps_lost(records, rounds, window_start)
    else:
        last_step, steps_lost = _last_step(records, window_start, injected_at), None
    reacted = sorted(
        _events(records, PEER_FAILURE, injected_at, window_end)
        + _events(records, EMERGENCY_SAVE, injected_at, window_end),
        key=lambda r: r["ts"],
    )
    detected_at = reacted[0]["ts"] if reacted else None
    resumed_at = final["ts"] if final else None
    later = _metrics(records, injected_at, window_end)
    after = recovery["world_size"] if recovery else (later[-1]["world_size"] if later else None)
    detection_s = seconds_since(detected_at, injected_at)
    resume_s = seconds_since(resumed_at, injected_at)
    paused_until = recovered_at if recovered_at is not None else window_end
    if math.isinf(paused_until):
        paused_until = max((r["ts"] for r in records), default=injected_at)
    paused = paused_intervals(records, injected_at, paused_until, pause_after)
    two_groups = [g for g in groups_at_once(records) if injected_at <= g["until"] < window_end]
    return {
        "index": injection["index"],
        "kind": injection["kind"],
        "description": injection.get("description", injection["kind"]),
        "injected_at": injected_at,
        "detected_at": detected_at,
        "resumed_at": resumed_at,
        "recovered_at": recovered_at,
        "detection_s": detection_s,
        "resume_s": resume_s,
        "detect_to_resume_s": (
            round(resume_s - detection_s, 3)
            if resume_s is not None and detection_s is not None
            else None
        ),
        "downtime_s": seconds_since(recovered_at, injected_at),
        "world_size_before": before[-1]["world_size"] if before else None,
        "world_size_after": after,
        "planned_world_size": planned,
        "rounds": _round_entries(records, rounds, window_end),
        "last_step_before": last_step,
        "resumed_step": int(final["step"]) if final else None,
        "steps_lost": steps_lost,
        "reported_lost_steps": _sum_known([r.get("lost_steps") for r in rounds]),
        "resume_source": final.get("source") if final else None,
        "recovered": recovery is not None and not two_groups,
        "two_groups": two_groups,
        "paused": paused,
        "paused_s": round(sum(end - start for start, end in paused), 3),
    }


def seconds_since(ts: float | None, origin: float) -> float | None:
    return round(ts - origin, 3) if ts is not None else None


def build_report(
    records: list[Record],
    injections: list[dict[str, Any]],
    *,
    start_ts: float,
    global_batch_size: int,
    max_steps: int,
    planned_faults: int,
    end_ts: float | None = None,
) -> dict[str, Any]:
    """The whole report: one entry per injected fault, plus totals for the run.

    ``end_ts`` is when the lab ended the run (its ``run_ended`` event). A run that did not
    finish is measured up to there: nodes stopped after it still log, e.g. the emergency
    saves of their shutdown.
    """
    faults: list[dict[str, Any]] = []
    window_start = -math.inf
    ordered = sorted(injections, key=lambda i: i["injected_at"])
    after_s = pause_after_s(records)
    for position, injection in enumerate(ordered):
        end = ordered[position + 1]["injected_at"] if position + 1 < len(ordered) else math.inf
        outcome = fault_outcome(records, injection, window_start, end, after_s)
        faults.append(outcome)
        window_start = outcome["recovered_at"] or injection["injected_at"]
    return {
        "start_ts": start_ts,
        "pause_after_s": round(after_s, 3),
        "faults": faults,
        "run": _run_totals(
            records, faults, start_ts, global_batch_size, max_steps, planned_faults, end_ts
        ),
    }


def _run_totals(
    records: list[Record],
    faults: list[dict[str, Any]],
    start_ts: float,
    global_batch_size: int,
    max_steps: int,
    planned_faults: int,
    end_ts: float | None,
) -> dict[str, Any]:
    finished = [r for r in records if r.get("event") == FINISHED]
    if finished:
        end_ts = finished[-1]["ts"]
    elif end_ts is None:
        end_ts = records[-1]["ts"] if records else start_ts
    metrics = [r for r in records if r["kind"] == METRICS and r["ts"] <= end_ts]
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
        "total_paused_s": round(sum(f["paused_s"] for f in faults), 3),
        "faults_planned": planned_faults,
        "faults_injected": len(faults),
        "faults_recovered": sum(1 for f in faults if f["recovered"]),
        "all_recovered": len(faults) == planned_faults and all(f["recovered"] for f in faults),
        "two_groups_at_once": len(groups_at_once(records)),
        **validation(records, end_ts),
    }


def validation(records: list[Record], end_ts: float) -> dict[str, Any]:
    """The task's evaluations (``evaluated`` events): the first and last validation loss, at
    which steps, and the last sampled line; None when the task logged none."""
    evaluated = [
        r
        for r in records
        if r.get("event") == EVALUATED and r["ts"] <= end_ts and finite_number(r.get("eval_loss"))
    ]
    if not evaluated:
        return {"validation": None}
    first, last = evaluated[0], evaluated[-1]
    return {
        "validation": {
            "evaluations": len(evaluated),
            "first_step": first["step"],
            "first_loss": first["eval_loss"],
            "last_step": last["step"],
            "last_loss": last["eval_loss"],
            "last_sample": last.get("sample"),
        }
    }
