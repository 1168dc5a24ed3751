"""The drill's table of a replacement's path, from recorded API answers: the cluster's events
and the pod watch's objects of one Spot eviction (``tests/recordings/kube/replacement_path.json``)
and the job's logs around it. The operator recreates the worker under its own name, as the
Kubeflow training operator does, so only the pod's uid tells the new one from the old."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lab.report.headroom import measured_replacement_s
from lab.report.replacement import STEPS, pod_change
from lab.report.run_logs import DRILL_EVENTS, POD_CHANGES, load_run
from lab.report.run_report import report_from_run
from lab.report.text import format_report
from tests.support.pod_logs import W0, W1, W2, eviction_story, stamp
from training.records import EMERGENCY_SAVE, EVENT, METRICS, PEER_FAILURE, RESUMED, STARTED

RECORDING = Path(__file__).parents[2] / "recordings" / "kube" / "replacement_path.json"


def _line(ts: float, **record: Any) -> str:
    return f"{stamp(ts)} {json.dumps({'ts': ts, 'rank': 0, **record})}"


def recorded_drill(root: Path, with_pod_watch: bool = True) -> float:
    """A drill's run directory around the recorded eviction; returns when it was requested."""
    recorded = json.loads(RECORDING.read_text())
    e = recorded["eviction_requested_at"]
    started = {"kind": EVENT, "event": STARTED, "max_steps": 2000, "global_batch_size": 256}
    logs: dict[str, list[str]] = {W0: [], W1: []}
    for pod in (W0, W1):
        logs[pod].append(_line(e - 3570, **started, world_size=3, rdzv_round=3))
    w2 = [_line(e - 3570, **started, world_size=3, rdzv_round=3)]
    metrics = {"kind": METRICS, "loss": 1.0, "rdzv_round": 3}
    logs[W0] += [
        _line(e - 60 + i, step=i, world_size=3, samples_per_s=500.0, **metrics) for i in range(60)
    ]
    w2.append(_line(e + 1.2, kind=EVENT, event=EMERGENCY_SAVE, step=59, reason="sigterm"))
    logs[W0].append(_line(e + 1.9, kind=EVENT, event=PEER_FAILURE, step=59))
    logs[W0].append(
        _line(e + 2.5, kind=EVENT, event=RESUMED, step=59, source="local", world_size=2)
    )
    logs[W0] += [
        _line(
            e + 3 + i, step=59 + i, world_size=2, samples_per_s=340.0, **metrics | {"rdzv_round": 4}
        )
        for i in range(1, 425)
    ]
    # The new pod's worker starts in round 5 with the others; its first step ends at +436.
    w2.append(_line(e + 428.4, **started, world_size=3, rdzv_round=5))
    logs[W0].append(
        _line(e + 429.0, kind=EVENT, event=RESUMED, step=483, source="local", world_size=3)
    )
    logs[W0] += [
        _line(
            e + 435 + i,
            step=483 + i,
            world_size=3,
            samples_per_s=500.0,
            **metrics | {"rdzv_round": 5},
        )
        for i in range(1, 6)
    ]
    (root / "pods").mkdir(parents=True)
    for pod, lines in {**logs, W2: w2}.items():
        (root / "pods" / f"{pod}.log").write_text("\n".join(lines) + "\n")
    events = recorded["events"]["items"]
    (root / "events.jsonl").write_text("".join(json.dumps(o) + "\n" for o in events))
    if with_pod_watch:
        rows = [
            {"ts": seen["observed_at"], **pod_change(seen["type"], seen["object"])}
            for seen in recorded["pod_watch"]
        ]
        (root / POD_CHANGES).write_text("".join(json.dumps(r) + "\n" for r in rows))
    drill = [
        {"ts": e - 10, "event": "run_started", "evictions": 1, "full_world_size": 3},
        {
            "ts": e,
            "event": "fault_injected",
            "index": 0,
            "kind": "evict",
            "description": f"evict {W2}'s node",
            "injected_at": e,
            "planned_world_size": 2,
        },
        {"ts": e + 441, "event": "run_ended"},
    ]
    (root / DRILL_EVENTS).write_text("".join(json.dumps(r) + "\n" for r in drill))
    return e


def test_every_step_of_the_replacement_from_the_clusters_own_records(tmp_path: Path) -> None:
    e = recorded_drill(tmp_path)
    (fault,) = report_from_run(load_run(tmp_path))["faults"]
    path = fault["replacement_steps"]
    assert (path["pod"], path["node"]) == (W2, "aks-gpu244695ac-12345678-vmss000003")
    rows = {row["step"]: row for row in path["steps"]}
    assert list(rows) == list(STEPS)
    assert {step: rows[step]["since_eviction_s"] for step in STEPS} == {
        "eviction requested": 0.0,
        "notice at the worker": 1.2,  # the evicted worker's emergency save
        "pod deleted": 1.0,  # its deletionTimestamp: whole seconds, as the API writes it
        "new pod Pending": 32.0,  # the new uid's creationTimestamp, not the old pod's
        "node requested": 62.0,  # the autoscaler's fixed delay for a GPU pod: 30 s
        "node Ready": 262.0,  # NodeReady, not the RegisteredNode 12 s before it
        "image pulled": 400.0,
        "container started": 401.0,  # the new container's startedAt, not the old one's
        "joined": 428.4,
        "first step at full size": 436.0,
    }
    assert rows["node Ready"]["since_previous_s"] == 200.0
    assert rows["pod deleted"]["source"] == f"pod watch: {W2} deletionTimestamp"
    assert rows["new pod Pending"]["source"] == f"pod watch: {W2} creationTimestamp"
    assert rows["node requested"]["source"] == f"event TriggeredScaleUp (Pod {W2})"
    assert rows["joined"]["source"] == f"job log: {W2} started (round 5, world 3)"
    assert rows["first step at full size"]["at"] == pytest.approx(e + 436.0)


def test_without_the_pod_watch_the_events_stand_in(tmp_path: Path) -> None:
    """A user's saved logs and `kubectl get events` have no pod watch: the kubelet's and the
    scheduler's events give the steps, each said so."""
    recorded_drill(tmp_path, with_pod_watch=False)
    (fault,) = report_from_run(load_run(tmp_path))["faults"]
    rows = {row["step"]: row for row in fault["replacement_steps"]["steps"]}
    assert (rows["pod deleted"]["since_eviction_s"], rows["pod deleted"]["source"]) == (
        1.0,
        f"event Killing (Pod {W2})",
    )
    assert rows["new pod Pending"]["source"] == f"event FailedScheduling (Pod {W2})"
    assert rows["new pod Pending"]["since_eviction_s"] == 32.0
    assert rows["container started"]["source"] == f"event Started (Pod {W2})"
    assert rows["container started"]["since_eviction_s"] == 401.0


def test_the_table_as_the_drill_prints_it(tmp_path: Path) -> None:
    recorded_drill(tmp_path)
    text = format_report(report_from_run(load_run(tmp_path)))
    table = text[text.index("fault 0: replacement") :].splitlines()
    assert table[0] == (
        f"fault 0: replacement {W2} on aks-gpu244695ac-12345678-vmss000003 in 436 s (eviction "
        "to the first step at full size), step by step:"
    )
    assert table[1].split() == ["step", "since", "eviction", "step", "took", "from"]
    assert table[8].split()[:6] == ["image", "pulled", "+400.0", "s", "138.0", "s"]
    assert table[11].split()[:7] == ["first", "step", "at", "full", "size", "+436.0", "s"]


def test_a_step_not_seen_says_so(tmp_path: Path) -> None:
    recorded_drill(tmp_path)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    kept = [o for o in events if o["reason"] not in ("Pulled", "NodeReady", "RegisteredNode")]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(o) + "\n" for o in kept))
    (fault,) = report_from_run(load_run(tmp_path))["faults"]
    rows = {row["step"]: row for row in fault["replacement_steps"]["steps"]}
    assert rows["image pulled"] == {
        "step": "image pulled",
        "at": None,
        "since_eviction_s": None,
        "since_previous_s": None,
        "source": "not seen",
    }
    assert rows["node Ready"]["source"] == "not seen"
    # The next step seen counts from the last one seen.
    assert rows["container started"]["since_previous_s"] == 401.0 - 62.0


def test_with_neither_pod_watch_nor_kubelet_start_the_new_pods_first_line_stands_in(
    tmp_path: Path,
) -> None:
    (leave, _) = report_from_run(load_run(eviction_story(tmp_path)))["faults"]
    rows = {row["step"]: row for row in leave["replacement_steps"]["steps"]}
    assert (rows["container started"]["since_eviction_s"], rows["container started"]["source"]) == (
        300.0,
        f"job log: {W2}x's first line",
    )
    assert rows["new pod Pending"]["source"] == "not seen"  # no FailedScheduling was saved


def test_the_last_row_is_the_replacement_time_lab_prices_reads(tmp_path: Path) -> None:
    recorded_drill(tmp_path)
    assert measured_replacement_s(report_from_run(load_run(tmp_path))) == [436.0]
