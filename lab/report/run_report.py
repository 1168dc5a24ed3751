"""A run's report from its saved logs, and the files it is written to.

The same report for a lab run and a cluster run (``lab.report.run_logs`` reads both). A
cluster run also gets each replacement's arrival (on the cloud a VM starts, pulls the image
and joins: that figure dominates) and, at the prices the caller found, the run's cost
(``gpu_cost.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lab.report.lab_run_details import add_lab_run_details, kept_with_earlier_report
from lab.report.outcomes import build_report, seconds_since
from lab.report.replacement import replacement_steps
from lab.report.run_logs import RunLogs
from lab.report.text import format_report
from lab.report.world_sizes import world_size_time
from training.records import METRICS


def report_from_run(run: RunLogs) -> dict[str, Any]:
    """The report of a run read by ``lab.report.run_logs``: the same for the lab and the cluster."""
    report = build_report(
        run.records,
        run.injections,
        start_ts=run.start_ts,
        global_batch_size=run.global_batch_size,
        max_steps=run.max_steps,
        planned_faults=run.planned_faults,
        end_ts=run.end_ts,
    )
    report["source"] = run.source
    report["world_sizes"] = world_sizes(run, report)
    if run.source == "lab":
        add_lab_run_details(report, run)
    if run.source == "cluster":
        # A replacement belongs to the loss before it, up to the next loss: a join in
        # between is the replacement arriving.
        losses = sorted(f["injected_at"] for f in report["faults"] if f["kind"] != "join")
        for fault in report["faults"]:
            if fault["kind"] != "join":
                nxt = next((t for t in losses if t > fault["injected_at"]), math.inf)
                fault["arrival"] = node_arrival(run, fault, nxt)
        add_replacement_steps(run, report)
    return report


def add_replacement_steps(run: RunLogs, report: dict[str, Any]) -> None:
    """Each loss's replacement path, step by step (``replacement.py``), up to the next loss."""
    losses = sorted(f["injected_at"] for f in report["faults"] if f["kind"] != "join")
    for fault in report["faults"]:
        if fault["kind"] != "join":
            nxt = next((t for t in losses if t > fault["injected_at"]), math.inf)
            fault["replacement_steps"] = replacement_steps(run, fault, nxt)


def world_sizes(run: RunLogs, report: dict[str, Any]) -> dict[str, Any] | None:
    """The time at each world size over the span the report measures, and what the missing
    workers cost (``world_sizes.py``)."""
    end = report["start_ts"] + report["run"]["wall_s"]
    return world_size_time(run.records, report["start_ts"], end, report["pause_after_s"])


def _first_event(run: RunLogs, after: float, reason: str, name: str | None = None) -> float | None:
    return next(
        (
            e.ts
            for e in run.cluster_events
            if e.ts >= after and e.reason == reason and (name is None or e.name == name)
        ),
        None,
    )


def node_arrival(run: RunLogs, fault: dict[str, Any], until: float) -> dict[str, Any] | None:
    """How the replacement for a fault arrived: the first pod that started after it, from
    the scale-up to the round it trained in at the size before the fault. On the cloud this
    figure (a VM starts, pulls the image, joins) dominates; the stages show where it goes."""
    injected = fault["injected_at"]
    first_seen: dict[str, float] = {}
    for record in run.records:
        first_seen.setdefault(record["node"], record["ts"])
    new = sorted((t, pod) for pod, t in first_seen.items() if injected < t < until)
    if not new:
        return None
    started_at, pod = new[0]
    node = run.node_at(pod, started_at)
    target = fault["world_size_before"]
    joined = next(
        (
            r["ts"]
            for r in run.records
            if r["kind"] == METRICS and started_at < r["ts"] < until and r["world_size"] == target
        ),
        None,
    )
    stages = {
        "scale_up_at": _first_event(run, injected, "TriggeredScaleUp"),
        "node_registered_at": _first_event(run, injected, "RegisteredNode", node) if node else None,
        "scheduled_at": _first_event(run, injected, "Scheduled", pod),
        "image_pulled_at": _first_event(run, injected, "Pulled", pod),
        "started_at": started_at,
        "joined_at": joined,
    }
    return {
        "pod": pod,
        "node": node,
        **{k: round(v, 3) if v is not None else None for k, v in stages.items()},
        "arrival_s": seconds_since(joined, injected),
    }


def write_outputs(out: Path, run: RunLogs, report: dict[str, Any]) -> None:
    """``report.json``, ``report.txt`` and ``timeline.png``: the same files for every run."""
    from lab.report.timeline_plot import plot_timeline  # matplotlib: only when a plot is written

    out.mkdir(parents=True, exist_ok=True)
    # A run's report is never lost to a rebuilt one: keys only it has stay.
    report = kept_with_earlier_report(out / "report.json", report)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.txt").write_text(format_report(report) + "\n")
    plot_timeline(run.records, report, out / "timeline.png")
