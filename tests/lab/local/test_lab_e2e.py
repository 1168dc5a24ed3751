"""The whole elastic story on one machine: ``python -m lab run --ci`` with a real etcd,
real torchrun agents and the real training program, then checks on what the logs show.

The CI scenario (``lab/local/scenarios/ci.toml``) starts three nodes and, in order: evicts one,
joins a new one, kills one hard, freezes one, joins another, restarts etcd, and finally
kills every node and starts two new ones.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from lab.local.scenario_file import load_scenario
from lab.report.node_logs import read_jsonl, read_records
from tests.support.lab_runs import _processes_of_the_run
from training.records import (
    CHECKPOINT_SAVED,
    EMERGENCY_SAVE,
    FINISHED,
    METRICS,
    PEER_FAILURE,
    RESUMED,
    STARTED,
    completed_step,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
CI = load_scenario("ci")
# Rendezvous (a key's TTL of 5 x 1 s and a probe) plus worker start and process-group init on
# a busy 2-core machine.
RENDEZVOUS_SLACK_S = 20.0


def _torchelastic_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("torchelastic_*"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, torchrun: None, heavy: None) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lab") / "run"
    temp_dirs_before = _torchelastic_dirs()
    result = subprocess.run(
        [sys.executable, "-m", "lab", "run", "--ci", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=CI.timeout_s + 60,
    )
    if not (out / "report.json").exists():
        pytest.fail(
            f"the lab wrote no report.json (exit code {result.returncode})\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
        )
    report = json.loads((out / "report.json").read_text())
    events = read_jsonl(out / "lab-events.jsonl")
    return {
        "result": result,
        "out": out,
        "report": report,
        "records": read_records(out / "nodes"),
        "raw": _raw_records(out / "nodes"),
        "events": events,
        "faults": {f["index"]: f for f in report["faults"]},
        "new_temp_dirs": _torchelastic_dirs() - temp_dirs_before,
    }


def _raw_records(log_dir: Path) -> list[dict[str, Any]]:
    """The workers' JSON lines, parsed here and not by the lab's reader it is checked against.
    A line cut off by SIGKILL is the only kind skipped."""
    records = []
    for path in sorted(log_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("kind") in ("metrics", "event"):
                records.append({**record, "node": path.stem})
    return sorted(records, key=lambda r: r["ts"])


def _by_kind(run: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [f for f in run["report"]["faults"] if f["kind"] == kind]


@pytest.mark.timeout(400)
def test_training_completes_and_every_fault_recovers(run: dict[str, Any]) -> None:
    assert run["result"].returncode == 0, run["result"].stderr[-3000:]
    report = run["report"]
    assert report["outcome"]["status"] == "finished"
    # On a loaded machine faults fall behind the schedule and the lab moves the end.
    end = report["run"]["extended_to_step"] or CI.train.max_steps
    assert end >= CI.train.max_steps
    assert report["run"]["final_step"] == end
    finished = [r for r in run["records"] if r.get("event") == FINISHED]
    assert [r["step"] for r in finished] == [end]
    assert len(report["faults"]) == len(CI.faults) == report["run"]["faults_recovered"]
    for fault in report["faults"]:
        assert fault["recovered"], fault
        assert fault["world_size_after"] == fault["planned_world_size"], fault
    assert (run["out"] / "timeline.png").stat().st_size > 10_000


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
        started = [r for r in run["records"] if r["node"] == node and r.get("event") == STARTED]
        assert started and min(r["ts"] for r in started) > event["injected_at"]
        assert any(r["world_size"] == join["world_size_after"] for r in started)


@pytest.mark.timeout(400)
def test_no_step_lost_to_graceful_or_hard_loss_with_survivors(run: dict[str, Any]) -> None:
    for kind in ("evict", "kill", "freeze"):
        (fault,) = _by_kind(run, kind)
        assert fault["steps_lost"] == 0, fault
        assert fault["resume_source"] == "local", fault
        assert fault["reported_lost_steps"] == 0, fault


@pytest.mark.timeout(400)
def test_silent_loss_is_found_by_the_rendezvous_not_the_collective_timeout(
    run: dict[str, Any],
) -> None:
    (freeze,) = _by_kind(run, "freeze")
    rendezvous = CI.rendezvous
    ttl_s = rendezvous.keep_alive_interval_s * rendezvous.keep_alive_max_attempt
    # The cluster's collective timeout is in force: the survivors' agents find the frozen
    # node's key expired and its probe unanswered, and stop their workers long before it.
    assert CI.train.collective_timeout_s == 30
    assert ttl_s - 1.0 <= freeze["detection_s"] < CI.train.collective_timeout_s / 2
    assert freeze["downtime_s"] <= ttl_s + RENDEZVOUS_SLACK_S
    assert freeze["steps_lost"] == 0


@pytest.mark.timeout(400)
def test_an_etcd_restart_is_survived(run: dict[str, Any]) -> None:
    (restart,) = _by_kind(run, "etcd-restart")
    assert restart["recovered"]
    assert restart["world_size_after"] == restart["world_size_before"]
    # etcd is down 2 s plus its start: past the fence's window (an outage shorter than 1.5 s
    # pauses nothing, docs/rendezvous.md) or not, depending on where it falls between two
    # keep-alives. Either the agents ride it out (no round resumes), or every agent stops its
    # workers at its fence, they save on their node, and the same nodes form the next round
    # from those saves: nobody is taken for dead, no step is lost.
    for round_ in restart["rounds"]:
        assert round_["world_size"] == restart["world_size_before"], restart
        assert round_["source"] == "local", restart
    if restart["rounds"]:
        assert restart["steps_lost"] == 0, restart
    later = [
        r
        for r in run["raw"]
        if r["kind"] == METRICS
        and r["ts"] > restart["recovered_at"]
        and r["world_size"] == restart["world_size_after"]
    ]
    assert later and later[-1]["step"] > restart["last_step_before"]


@pytest.mark.timeout(400)
def test_a_full_restart_resumes_from_the_durable_checkpoint(run: dict[str, Any]) -> None:
    (kill_all,) = _by_kind(run, "kill-all")
    # The first round after it: a round of one may form before the second new node joined.
    first = kill_all["rounds"][0]
    assert first["source"] == "durable"
    # Durable commits: periodic checkpoints and rank 0's saves on SIGTERM.
    saved = [
        r["step"]
        for r in run["raw"]
        if r["ts"] < kill_all["injected_at"]
        and (r.get("event") == CHECKPOINT_SAVED or r.get("durable") is True)
    ]
    assert first["step"] == max(saved)
    assert kill_all["steps_lost"] >= kill_all["last_step_before"] - max(saved) >= 0
    if len(kill_all["rounds"]) == 1:
        assert kill_all["steps_lost"] == kill_all["last_step_before"] - max(saved)
    injected = next(e for e in run["events"] if e.get("kind") == "kill-all")
    resumed = [
        r for r in run["raw"] if r.get("event") == RESUMED and r["ts"] > injected["injected_at"]
    ]
    assert {r["node"] for r in resumed} <= set(injected["started"])


def _recompute(raw: list[dict], event: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """The report's definitions (``lab/report/outcomes.py``), computed again straight from the raw
    node logs: recovery is the first line at the planned world size, after the first round
    that resumed after the fault when one did."""
    injected_at, planned = event["injected_at"], event["planned_world_size"]
    window = [r for r in raw if injected_at <= r["ts"] < end]
    resumes = [r for r in window if r.get("event") == RESUMED]
    since = resumes[0]["ts"] if resumes else injected_at
    line = next(
        r
        for r in window
        if r["kind"] == METRICS and r["ts"] >= since and r["world_size"] == planned
    )
    rounds = [r for r in resumes if r["ts"] < line["ts"]]
    reacted = [r for r in window if r.get("event") in (PEER_FAILURE, EMERGENCY_SAVE)]
    before = [r for r in raw if r["kind"] == METRICS and r["ts"] < injected_at]
    lost, progress_from, previous = 0, start, None
    for round_ in rounds:
        seen = [
            step
            for r in raw
            if progress_from <= r["ts"] < round_["ts"] and (step := completed_step(r)) is not None
        ]
        known = seen + ([previous] if previous is not None else [])
        assert known, f"no progress seen before the round {round_}"
        lost += max(max(known) - round_["step"], 0)
        progress_from, previous = round_["ts"], round_["step"]
    return {
        "downtime_s": line["ts"] - injected_at,
        "detection_s": reacted[0]["ts"] - injected_at if reacted else None,
        "world_size_before": before[-1]["world_size"],
        "world_size_after": line["world_size"],
        "resumed_step": rounds[-1]["step"] if rounds else None,
        "resume_source": rounds[-1]["source"] if rounds else None,
        "steps_lost": lost if rounds else None,
        "recovered": True,
    }


@pytest.mark.timeout(400)
def test_report_matches_the_node_logs(run: dict[str, Any]) -> None:
    raw, report = run["raw"], run["report"]
    injected = [e for e in run["events"] if e["event"] == "fault_injected"]
    start = -math.inf
    for position, event in enumerate(injected):
        end = injected[position + 1]["injected_at"] if position + 1 < len(injected) else math.inf
        fault = run["faults"][event["index"]]
        assert fault["injected_at"] == event["injected_at"]
        expected = _recompute(raw, event, start, end)
        for key in ("downtime_s", "detection_s"):
            if expected[key] is None:
                assert fault[key] is None, (key, fault)
            else:
                assert fault[key] == pytest.approx(expected[key], abs=1e-3), (key, fault)
        for key in (
            "world_size_before",
            "world_size_after",
            "resumed_step",
            "resume_source",
            "steps_lost",
            "recovered",
        ):
            assert fault[key] == expected[key], (key, fault)
        start = fault["recovered_at"]
    metrics = [r for r in raw if r["kind"] == METRICS]
    assert report["run"]["final_loss"] == metrics[-1]["loss"]


@pytest.mark.timeout(400)
def test_throughput_is_the_work_done_over_the_wall_time(run: dict[str, Any]) -> None:
    totals = run["report"]["run"]
    (finished,) = [r for r in run["raw"] if r.get("event") == FINISHED]
    wall_s = finished["ts"] - run["report"]["start_ts"]
    assert totals["final_step"] == finished["step"]
    assert totals["wall_s"] == pytest.approx(wall_s, abs=1e-3)
    expected = finished["step"] * CI.train.global_batch_size / wall_s
    assert totals["samples_per_s"] == pytest.approx(expected, abs=0.01)


# torchrun's agent at INFO: "I1123 16:29:57.735000 10522 .../api.py:553] [default]
# Rendezvous complete for workers. Result:" and, on the following lines of the same pid,
# "  group_world_size=2".
_GLOG = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) (\d+) ")


def _agent_rounds(log: Path, year: int) -> list[tuple[float, int]]:
    """(when, group_world_size) of every rendezvous round the node's agents completed."""
    rounds: list[tuple[float, int]] = []
    pending: dict[str, float] = {}  # agent pid -> time of its "Rendezvous complete" line
    for line in log.read_text(errors="replace").splitlines():
        match = _GLOG.match(line)
        if match is None:
            continue
        month, day, hour, minute, second, micros, pid = (int(g) for g in match.groups())
        when = datetime(year, month, day, hour, minute, second, micros).timestamp()
        if "Rendezvous complete for workers" in line:
            pending[str(pid)] = when
        elif "group_world_size=" in line and str(pid) in pending:
            size = int(line.rsplit("group_world_size=", 1)[1].split()[0])
            rounds.append((pending.pop(str(pid)), size))
    return rounds


@pytest.mark.timeout(400)
def test_world_sizes_match_the_rendezvous_rounds_the_agents_logged(run: dict[str, Any]) -> None:
    raw = run["raw"]
    year = datetime.fromtimestamp(raw[0]["ts"]).year
    rounds = {
        log.stem: _agent_rounds(log, year) for log in sorted((run["out"] / "nodes").glob("*.log"))
    }
    assert all(rounds.values()), "every node's agent logs its rounds (LOGLEVEL=INFO)"

    def agent_world_size(node: str, ts: float) -> int:
        return max((r for r in rounds[node] if r[0] <= ts), key=lambda r: r[0])[1]

    started = [r for r in raw if r.get("event") == STARTED]
    assert started
    for record in started:  # every worker of every round, on every node
        assert agent_world_size(record["node"], record["ts"]) == record["world_size"], record
    for fault in run["report"]["faults"]:
        line = next(r for r in raw if r["kind"] == METRICS and r["ts"] == fault["recovered_at"])
        assert agent_world_size(line["node"], line["ts"]) == fault["world_size_after"], fault


@pytest.mark.timeout(400)
def test_nothing_is_left_behind(run: dict[str, Any]) -> None:
    session = next(e for e in run["events"] if e["event"] == "session_started")
    workspace = session["workspace"]
    assert not Path(workspace).exists()  # etcd data, checkpoints, node-local and temp dirs
    survivors = _processes_of_the_run(session["rdzv_id"], workspace)
    assert survivors == [], f"processes of the run still alive: {survivors}"
    assert (run["out"] / "etcd.log").exists()
    # Every agent kept its torchelastic_* dir in the node's TMPDIR inside the workspace (a
    # node the lab stopped before its agent started, training done, logged none) ...
    for log in (run["out"] / "nodes").glob("*.log"):
        log_dirs = re.findall(r"log_dir\s+: (\S+)", log.read_text(errors="replace"))
        records = log.with_suffix(".jsonl")
        trained = records.exists() and records.read_text().strip() != ""
        assert log_dirs or not trained, log
        assert all(d.startswith(workspace + "/") for d in log_dirs), log
    # ... and none of this run's is in the system's temp dir.
    ours = [d for d in run["new_temp_dirs"] if any(d.glob(f"{session['rdzv_id']}_*"))]
    assert ours == []


def _report_from_logs(logs: Path, out: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "lab", "report", "--logs", str(logs), "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads((out / "report.json").read_text())


@pytest.mark.timeout(400)
def test_the_report_rebuilt_from_the_saved_logs_is_the_runs_report(
    run: dict[str, Any], tmp_path: Path
) -> None:
    rebuilt = _report_from_logs(run["out"], tmp_path / "again")
    assert rebuilt == run["report"]  # the outcome, the scenario and lingering nodes too
    assert (tmp_path / "again" / "timeline.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(400)
def test_the_same_logs_as_pod_logs_give_the_same_faults(
    run: dict[str, Any], tmp_path: Path
) -> None:
    """The lab's node logs rewritten as `kubectl logs --timestamps` prints a pod's, with the
    lab's injections as a drill's: the cluster path gives the same faults, steps and losses."""
    pods = tmp_path / "cluster" / "pods"
    pods.mkdir(parents=True)
    for path in sorted((run["out"] / "nodes").glob("*.jsonl")):
        lines = []
        for line in path.read_text().splitlines():
            try:
                ts = json.loads(line)["ts"]
            except (ValueError, KeyError, TypeError):
                continue  # kubectl prints every line; a torn one has no time of its own
            stamp = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            lines.append(f"{stamp}.{int(ts % 1 * 1e9):09d}Z {line}")
        (pods / f"{path.stem}.log").write_text("\n".join(lines) + "\n")
    drill = (run["out"] / "lab-events.jsonl").read_text()
    (tmp_path / "cluster" / "drill-events.jsonl").write_text(drill)
    rebuilt = _report_from_logs(tmp_path / "cluster", tmp_path / "out")
    assert rebuilt["source"] == "cluster"
    keys = ("kind", "injected_at", "resumed_step", "steps_lost", "world_size_before")
    keys += ("world_size_after", "recovered", "resume_source", "paused")
    assert [{k: f[k] for k in keys} for f in rebuilt["faults"]] == [
        {k: f[k] for k in keys} for f in run["report"]["faults"]
    ]
    assert rebuilt["run"]["final_step"] == run["report"]["run"]["final_step"]
