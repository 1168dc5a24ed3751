"""Recovery benchmarks: one lab session per (repetition, fault kind, profile), interleaved.

Each session trains a tiny model on real torchrun agents with a real etcd, injects one fault
after warm-up and ends when training finishes, or when the fault has not recovered within
the plan's cap. The lab's report gives downtime and steps lost; ``bench.stages`` says where
the time went. Within a repetition the two profiles run back to back for each fault kind,
and which goes first alternates between repetitions, so drift in the machine's load is shared.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.profiles import PROFILE_NAMES, Profile, profile
from bench.scenarios import RecoveryPlan, recovery_scenario
from bench.stages import PHASES, STAGES, recovery_stages
from bench.stats import median_of, ratio, summarize, summarize_known
from lab.local.session import SessionOptions, run_session
from lab.report.node_logs import read_records
from lab.report.outcomes import pause_after_s, paused_intervals
from training.records import RESUMED, Record


def measure_run(
    report: dict[str, Any],
    records: list[Record],
    *,
    rep: int,
    kind: str,
    profile_name: str,
    cap_s: float,
) -> dict[str, Any]:
    """One session's figures: downtime, steps lost and stages, or why there are none.

    A fault that did not recover before the session gave up (status ``timeout``) has no
    downtime, only ``no_recovery_within_s``; any other failure is an ``error``.
    """
    outcome = report["outcome"]
    run: dict[str, Any] = {
        "rep": rep,
        "kind": kind,
        "profile": profile_name,
        "status": outcome["status"],
        "message": outcome["message"],
        "recovered": False,
        "downtime_s": None,
        "no_recovery_within_s": None,
        "steps_lost": None,
        "error": None,
        "stages": None,
    }
    if not report["faults"]:
        return {**run, "error": f"the fault was never injected: {outcome['message']}"}
    fault = report["faults"][0]
    run.update(
        step_at_fault=fault["last_step_before"],
        world_size_before=fault["world_size_before"],
        world_size_after=fault["world_size_after"],
        resume_source=fault["resume_source"],
    )
    if kind == "etcd":
        return {**run, **_outage_figures(fault, records)}
    if fault["recovered"]:
        return {
            **run,
            "recovered": True,
            "downtime_s": fault["downtime_s"],
            "steps_lost": fault["steps_lost"],
            "stages": recovery_stages(fault, records),
        }
    if outcome["status"] == "timeout":
        return {**run, "no_recovery_within_s": cap_s}
    return {**run, "error": f"not recovered: {outcome['message']}"}


def _outage_figures(fault: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    """etcd down, nobody lost: how long training stood still, and how many rounds it cost,
    from the outage to the end of the session (which waits out the keep-alive bound)."""
    injected = float(fault["injected_at"])
    end = max((float(r["ts"]) for r in records), default=injected)
    paused = paused_intervals(records, injected, end, pause_after_s(records))
    rounds = [r for r in records if r.get("event") == RESUMED and r["ts"] > injected]
    paused_s = round(sum(b - a for a, b in paused), 3)
    return {
        "recovered": True,
        "downtime_s": paused_s,
        "steps_lost": fault["steps_lost"] or 0,
        "restarts": len(rounds),
        "stages": {"paused_s": paused_s} if not rounds else recovery_stages(fault, records),
    }


def _profile_summary(runs: list[dict[str, Any]], cap_s: float) -> dict[str, Any]:
    measured = [r for r in runs if r["error"] is None]
    stages = [r["stages"] for r in measured if r["stages"]]
    return {
        "restarts": summarize_known([r.get("restarts") for r in measured]),
        "downtime_s": summarize([r["downtime_s"] for r in measured], cap_s) if measured else None,
        "paused_s": summarize_known([s["paused_s"] for s in stages]),
        "steps_lost": summarize_known([r["steps_lost"] for r in measured]),
        "stages": {name: median_of([s.get(name) for s in stages]) for name in (*STAGES, "total_s")},
        "phases": {
            name: median_of([s.get("phases", {}).get(name) for s in stages]) for name in PHASES
        },
        "errors": len(runs) - len(measured),
    }


def summarize_recovery(
    runs: list[dict[str, Any]], kinds: tuple[str, ...], cap_s: float
) -> dict[str, Any]:
    """Per fault kind and profile: downtime, steps lost, stage medians; baseline over lab."""
    summary: dict[str, Any] = {}
    for kind in kinds:
        entry: dict[str, Any] = {}
        for name in PROFILE_NAMES:
            mine = [r for r in runs if r["kind"] == kind and r["profile"] == name]
            if mine:
                entry[name] = _profile_summary(mine, cap_s)
        if len(entry) == len(PROFILE_NAMES):
            entry["downtime_ratio"] = ratio(
                entry[PROFILE_NAMES[0]]["downtime_s"], entry[PROFILE_NAMES[1]]["downtime_s"]
            )
        summary[kind] = entry
    return summary


def session_order(rep: int) -> tuple[str, ...]:
    """Baseline first in even repetitions, the lab first in odd ones."""
    return PROFILE_NAMES if rep % 2 == 0 else tuple(reversed(PROFILE_NAMES))


def run_one(
    kind: str, prof: Profile, plan: RecoveryPlan, out: Path, data_dir: Path, python: str, rep: int
) -> dict[str, Any]:
    """One session of ``kind`` under ``prof``; its measured figures."""
    scenario = recovery_scenario(kind, prof, plan)
    options = SessionOptions(out_dir=out, data_dir=data_dir, python=python)
    report = run_session(scenario, options, None)
    records = read_records(out / "nodes")
    run = measure_run(
        report, records, rep=rep, kind=kind, profile_name=prof.name, cap_s=plan.recovery_cap_s
    )
    return {**run, "session_dir": str(out)}


def describe_run(run: dict[str, Any]) -> str:
    """One progress line, e.g. ``rep 1 kill baseline: downtime 46.1 s, 12 steps lost``."""
    head = f"rep {run['rep'] + 1} {run['kind']:<6} {run['profile']:<8}"
    if run["error"]:
        return f"{head}: ERROR {run['error'][:200]}"
    if not run["recovered"]:
        return f"{head}: no recovery within {run['no_recovery_within_s']:g} s"
    return f"{head}: downtime {run['downtime_s']:.1f} s, {run['steps_lost']} steps lost"


def measure_recovery(
    plan: RecoveryPlan,
    *,
    kinds: tuple[str, ...],
    reps: int,
    out_dir: Path,
    data_dir: Path,
    python: str = sys.executable,
    on_run: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Every (rep, kind, profile) session; the runs and their summary."""
    plan.validate()
    if reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}")
    runs: list[dict[str, Any]] = []
    total = reps * len(kinds) * len(PROFILE_NAMES)
    for rep in range(reps):
        for kind in kinds:
            for name in session_order(rep):
                out = out_dir / f"rep{rep + 1}-{kind}-{name}"
                run = run_one(kind, profile(name), plan, out, data_dir, python, rep)
                runs.append(run)
                on_run(f"[{len(runs):>2}/{total}] {describe_run(run)}")
    return {
        "plan": {**dataclasses.asdict(plan), "reps": reps, "kinds": list(kinds)},
        "runs": runs,
        "summary": summarize_recovery(runs, kinds, plan.recovery_cap_s),
    }
