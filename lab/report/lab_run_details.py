"""What a lab run's own files add to its report, and a report that never loses a key.

The lab's event log says how the run ended, which agents lingered after the end, which
faults fired late and how far the run was extended; ``scenario.json`` names the scenario.
``lab run`` and ``lab report --logs`` both read them from there, so a report rebuilt from a
run's logs is the run's own report. A rebuilt report is merged over the one already in its
directory: a key that only the older one has (from another version of the lab) stays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lab.report.run_logs import RunLogs


def add_lab_run_details(report: dict[str, Any], run: RunLogs) -> None:
    """The scenario, the outcome, lingering nodes, late faults and the run's extension."""
    events = run.lab_events
    report["scenario"] = run.scenario
    ended = [e for e in events if e["event"] == "run_ended"]
    if ended:
        report["outcome"] = {"status": ended[-1].get("status"), "message": ended[-1].get("message")}
    # Agents still in their exit barrier after training finished: a pod that never completes.
    report["run"]["lingering_nodes"] = [
        e.get("node") for e in events if e["event"] == "node_lingered"
    ]
    extended = [e.get("max_steps") for e in events if e["event"] == "run_extended"]
    report["run"]["extended_to_step"] = extended[-1] if extended else None
    report["late_faults"] = [
        {
            "index": e["index"],
            "description": e.get("description"),
            "waited_from_step": e["late_from_step"],
            "injected_at_step": e.get("step_at_injection"),
        }
        for e in run.injections
        if e.get("late_from_step") is not None
    ]


def merged(earlier: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with every key of ``earlier`` it lacks, table by table; its values win."""
    result = dict(earlier)
    for key, value in report.items():
        before = earlier.get(key)
        both_tables = isinstance(before, dict) and isinstance(value, dict)
        result[key] = merged(before, value) if both_tables else value
    return result


def kept_with_earlier_report(path: Path, report: dict[str, Any]) -> dict[str, Any]:
    """``report`` merged over the report already at ``path`` (itself when there is none, or
    when that file is not a JSON object: then there is nothing to keep)."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return report
    return merged(earlier, report) if isinstance(earlier, dict) else report
