"""``lab report --logs`` over a lab run's directory: the rebuilt report is the run's own and
never loses a key the run's report.json had."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lab.cli import main
from training.records import EVENT, FINISHED, METRICS, RESUMED

T0 = 1_790_000_000.0


def _lines(*records: dict[str, Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _lab_run(root: Path) -> Path:
    """A finished two-node lab run with one kill, one lingering agent and one extension."""
    nodes = root / "nodes"
    nodes.mkdir(parents=True)
    steps = [
        {
            "ts": T0 + s,
            "kind": METRICS,
            "step": s,
            "world_size": 2 if s < 4 else 1,
            "loss": 1.0,
            "samples_per_s": 8.0,
        }
        for s in range(1, 9)
    ]
    resumed = {"ts": T0 + 3.5, "kind": EVENT, "event": RESUMED, "step": 3, "world_size": 1}
    finished = {"ts": T0 + 8.1, "kind": EVENT, "event": FINISHED, "step": 8}
    (nodes / "node-0.jsonl").write_text(_lines(*steps[:3], resumed, *steps[3:], finished))
    (nodes / "node-1.jsonl").write_text("")
    (root / "lab-events.jsonl").write_text(
        _lines(
            {"ts": T0, "event": "run_started", "scenario": "tiny"},
            {"ts": T0 + 2.5, "event": "run_extended", "max_steps": 8, "step": 2},
            {
                "ts": T0 + 3.2,
                "event": "fault_injected",
                "index": 0,
                "kind": "kill",
                "description": "kill node-1 @ step 2",
                "injected_at": T0 + 3.2,
                "step_at_injection": 3,
                "late_from_step": 2,
                "planned_world_size": 1,
            },
            {"ts": T0 + 9, "event": "node_lingered", "node": "node-0", "code": None},
            {"ts": T0 + 9.5, "event": "run_ended", "status": "finished", "message": "done"},
        )
    )
    scenario = {
        "name": "tiny",
        "train": {"max_steps": 6, "global_batch_size": 8},
        "faults": [{"kind": "kill", "node": 1, "at_step": 2}],
    }
    (root / "scenario.json").write_text(json.dumps(scenario))
    return root


def test_the_lab_runs_own_details_come_from_its_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = _lab_run(tmp_path / "run")
    assert main(["report", "--logs", str(logs), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["scenario"] == "tiny"
    assert report["outcome"] == {"status": "finished", "message": "done"}
    assert report["run"]["lingering_nodes"] == ["node-0"]
    assert report["run"]["extended_to_step"] == 8
    assert report["late_faults"] == [
        {
            "index": 0,
            "description": "kill node-1 @ step 2",
            "waited_from_step": 2,
            "injected_at_step": 3,
        }
    ]
    text = capsys.readouterr().out
    assert "fault 0 (kill node-1 @ step 2) fired late, at step 3: from step 2 it waited" in text
    assert "the run extended to step 8 (max_steps 6)" in text


def test_rebuilding_in_place_keeps_every_key_of_the_runs_report(tmp_path: Path) -> None:
    logs = _lab_run(tmp_path / "run")
    own = {
        "scenario": "tiny",
        "outcome": {"status": "finished", "message": "done"},
        "run": {"lingering_nodes": ["node-0"], "written_by": "an older lab"},
        "notes": ["a key this version does not write"],
    }
    (logs / "report.json").write_text(json.dumps(own))
    assert main(["report", "--logs", str(logs)]) == 0
    report = json.loads((logs / "report.json").read_text())
    assert report["scenario"] == "tiny"
    assert report["outcome"] == own["outcome"]
    assert report["run"]["lingering_nodes"] == ["node-0"]
    assert report["run"]["written_by"] == "an older lab"
    assert report["notes"] == own["notes"]
    assert report["run"]["final_step"] == 8  # and what the logs say is rebuilt
