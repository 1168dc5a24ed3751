"""The whole elastic story on one machine: ``python -m lab run --ci`` with a real etcd,
real torchrun agents and the real training program, then checks on what the logs show.

The CI scenario (``lab/scenarios/ci.toml``) starts three nodes and, in order: evicts one,
joins a new one, kills one hard, freezes one, joins another, restarts etcd, and finally
kills every node and starts two new ones.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lab.node_logs import read_jsonl, read_records
from lab.scenario_file import load_scenario

REPO_ROOT = Path(__file__).resolve().parents[1]
CI = load_scenario("ci")
# Rendezvous (keep-alive 3 x 1 s, last call 1 s) plus process start, import torch and
# process-group init on a busy 2-core machine.
RENDEZVOUS_SLACK_S = 20.0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lab") / "run"
    result = subprocess.run(
        [sys.executable, "-m", "lab", "run", "--ci", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=CI.timeout_s + 60,
    )
    report = json.loads((out / "report.json").read_text())
    events = read_jsonl(out / "lab-events.jsonl")
    return {
        "result": result,
        "out": out,
        "report": report,
        "records": read_records(out / "nodes"),
        "events": events,
        "faults": {f["index"]: f for f in report["faults"]},
    }


def _by_kind(run: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [f for f in run["report"]["faults"] if f["kind"] == kind]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_training_completes_and_every_fault_recovers(run: dict[str, Any]) -> None:
    assert run["result"].returncode == 0, run["result"].stderr[-3000:]
    report = run["report"]
    assert report["outcome"]["status"] == "finished"
    assert report["run"]["final_step"] == CI.train.max_steps
    finished = [r for r in run["records"] if r.get("event") == "finished"]
    assert [r["step"] for r in finished] == [CI.train.max_steps]
    assert len(report["faults"]) == len(CI.faults) == report["run"]["faults_recovered"]
    for fault in report["faults"]:
        assert fault["recovered"], fault
        assert fault["world_size_after"] == fault["planned_world_size"], fault
    assert (run["out"] / "timeline.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_new_nodes_joined_and_the_world_grew(run: dict[str, Any]) -> None:
    joins = _by_kind(run, "join")
    assert len(joins) == 2
    for join in joins:
        assert join["world_size_after"] == join["world_size_before"] + 1
    # The joined nodes never took part before, and they trained in the grown world.
    injected = [e for e in run["events"] if e["event"] == "fault_injected" and e["kind"] == "join"]
    for event, join in zip(injected, joins, strict=True):
        (node,) = event["started"]
        started = [r for r in run["records"] if r["node"] == node and r.get("event") == "started"]
        assert started and min(r["ts"] for r in started) > event["injected_at"]
        assert any(r["world_size"] == join["world_size_after"] for r in started)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_no_step_lost_to_graceful_or_hard_loss_with_survivors(run: dict[str, Any]) -> None:
    for kind in ("evict", "kill", "freeze"):
        (fault,) = _by_kind(run, kind)
        assert fault["steps_lost"] == 0, fault
        assert fault["resume_source"] == "local", fault
        assert fault["reported_lost_steps"] == 0, fault


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_silent_loss_ends_with_the_collective_timeout(run: dict[str, Any]) -> None:
    (freeze,) = _by_kind(run, "freeze")
    timeout_s = CI.train.collective_timeout_s
    # Nothing notices a frozen peer before the timeout; the timeout does end the wait.
    assert timeout_s - 1.0 <= freeze["detection_s"] <= timeout_s + RENDEZVOUS_SLACK_S
    assert freeze["downtime_s"] <= timeout_s + RENDEZVOUS_SLACK_S


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_etcd_restart_is_survived(run: dict[str, Any]) -> None:
    (restart,) = _by_kind(run, "etcd-restart")
    assert restart["recovered"]
    assert restart["world_size_after"] == restart["world_size_before"]
    later = [
        r
        for r in run["records"]
        if r["kind"] == "metrics"
        and r["ts"] > restart["recovered_at"]
        and r["world_size"] == restart["world_size_after"]
    ]
    assert later and later[-1]["step"] > restart["resumed_step"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_full_restart_resumes_from_the_durable_checkpoint(run: dict[str, Any]) -> None:
    (kill_all,) = _by_kind(run, "kill-all")
    assert kill_all["resume_source"] == "durable"
    # Durable commits: periodic checkpoints and rank 0's saves on SIGTERM.
    saved = [
        r["step"]
        for r in run["records"]
        if r["ts"] < kill_all["injected_at"]
        and (r.get("event") == "checkpoint_saved" or r.get("durable") is True)
    ]
    assert kill_all["resumed_step"] == max(saved)
    assert kill_all["steps_lost"] == kill_all["last_step_before"] - max(saved) >= 0
    injected = next(e for e in run["events"] if e.get("kind") == "kill-all")
    resumed = [
        r
        for r in run["records"]
        if r.get("event") == "resumed" and r["ts"] > injected["injected_at"]
    ]
    assert {r["node"] for r in resumed} <= set(injected["started"])


def _recompute(records: list[dict], injected_at: float, start: float, end: float) -> dict:
    """The report's definitions, computed again here straight from the node logs."""
    window = [r for r in records if injected_at <= r["ts"] < end]
    resumes = [r for r in window if r.get("event") == "resumed"]
    line = next(
        r for r in window if r["kind"] == "metrics" and any(x["ts"] < r["ts"] for x in resumes)
    )
    resumed = max((x for x in resumes if x["ts"] < line["ts"]), key=lambda x: x["ts"])
    progress = [
        r["step"]
        for r in records
        if start <= r["ts"] < resumed["ts"]
        and (r["kind"] == "metrics" or r.get("event") in ("checkpoint_saved", "emergency_save"))
    ]
    return {
        "downtime_s": line["ts"] - injected_at,
        "world_size_after": line["world_size"],
        "resumed_step": resumed["step"],
        "steps_lost": max(progress) - resumed["step"],
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_report_matches_the_node_logs(run: dict[str, Any]) -> None:
    records, report = run["records"], run["report"]
    injected = [e for e in run["events"] if e["event"] == "fault_injected"]
    start = -math.inf
    for position, event in enumerate(injected):
        end = injected[position + 1]["injected_at"] if position + 1 < len(injected) else math.inf
        fault = run["faults"][event["index"]]
        assert fault["injected_at"] == event["injected_at"]
        expected = _recompute(records, event["injected_at"], start, end)
        assert fault["downtime_s"] == pytest.approx(expected["downtime_s"], abs=1e-3)
        for key in ("world_size_after", "resumed_step", "steps_lost"):
            assert fault[key] == expected[key], (key, fault)
        start = fault["recovered_at"]
    metrics = [r for r in records if r["kind"] == "metrics"]
    assert report["run"]["final_loss"] == metrics[-1]["loss"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nothing_is_left_behind(run: dict[str, Any]) -> None:
    session = next(e for e in run["events"] if e["event"] == "session_started")
    assert not Path(session["workspace"]).exists()  # etcd data, checkpoints, node-local dirs
    marker = f"PET_RDZV_ID={session['rdzv_id']}".encode()
    survivors = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes():
                survivors.append(int(proc.name))
        except OSError:
            continue
    assert survivors == [], f"processes of the run still alive: {survivors}"
    assert os.path.exists(run["out"] / "etcd.log")
