"""The autoscaler's capacity events, each as one line: no Spot capacity, falling back to
on-demand, back on Spot. The events are recorded in the shapes the autoscaler's source gives them
(``tests/recordings/kube/README.md`` names each file and function)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

from lab.azure.cluster.capacity_lines import CapacityLines
from lab.azure.cluster.cloud_run import watch
from lab.azure.cluster.follow import CloudOptions
from lab.live.status_line import StatusLine
from lab.report.run_logs import cluster_event
from tests.support.cluster_runs import _outputs
from tests.support.kube_replay import FakeKube, job_manifest, pod_manifest, serve_kube
from tests.support.pod_logs import W0, W1

RECORDED = Path(__file__).parents[2] / "recordings" / "kube" / "autoscaler_events.json"
UNFIT = RECORDED.with_name("unfit_worker_events.json")


def _recorded() -> list[dict[str, Any]]:
    return json.loads(RECORDED.read_text())["items"]


def test_each_recorded_event_is_one_line_in_order() -> None:
    lines = CapacityLines()
    said = []
    for obj in _recorded():
        event = cluster_event(obj)
        assert event is not None
        said.append(lines.line(event))
    assert said == [
        None,  # a Spot scale-up is what should happen: the status line's last event says it
        "no Spot capacity: pool gpu244695ac could not add a node "
        "(OutOfResource.provisioning-state-failed)",
        "no Spot capacity: pool gpu244695ac could not add a node (AllocationFailed)",
        "no Spot capacity: pool gpu244695ac could not add a node (no node registered within "
        "10m4.315s)",
        "no Spot capacity: pool gpu244695ac could not add a node (SkuNotAvailable)",
        "no Spot capacity: spotlab-train-worker-0 waits for a GPU node; the autoscaler backs off "
        "a pool after a failed scale-up (1 in backoff after failed scale-up, 2 node(s) didn't "
        "match Pod's node affinity/selector)",
        "falling back to on-demand: spotlab-train-worker-0 scales pool ondc0143d44 0->2",
        "no on-demand capacity either: pool ondc0143d44 could not add a node "
        "(OperationNotAllowed: out of quota)",
        "back on Spot: node aks-gpu244695ac-12345678-vmss000004",
    ]
    assert all(line is None or "\n" not in line for line in said)


def test_back_on_spot_is_said_once_after_a_fallback_and_only_then() -> None:
    lines = CapacityLines()
    registered, scheduled = (
        cluster_event(
            {
                "reason": reason,
                "involvedObject": {"kind": kind, "name": name},
                "message": message,
                "lastTimestamp": "2026-11-26T12:40:00Z",
            }
        )
        for reason, kind, name, message in (
            ("RegisteredNode", "Node", "aks-gpu244695ac-12345678-vmss000004", "Registered"),
            (
                "Scheduled",
                "Pod",
                W1,
                f"Successfully assigned spot-lab/{W1} to aks-gpu244695ac-12345678-vmss000004",
            ),
        )
    )
    assert registered and scheduled
    assert lines.line(registered) is None and lines.line(scheduled) is None  # no fallback yet
    fallback = _recorded()[6]
    assert fallback["reason"] == "TriggeredScaleUp"
    event = cluster_event(fallback)
    assert event and lines.line(event) is not None
    assert lines.line(scheduled) == f"back on Spot: {W1} on aks-gpu244695ac-12345678-vmss000004"
    assert lines.line(registered) is None  # said once


def test_a_failure_of_a_pool_that_is_not_ours_is_still_one_line() -> None:
    event = cluster_event(
        {
            "reason": "ScaleUpTimedOut",
            "involvedObject": {"kind": "ConfigMap", "name": "cluster-autoscaler-status"},
            "message": "Nodes added to group aks-userpool-87654321-vmss failed to register "
            "within 15m0s",
            "lastTimestamp": "2026-11-26T12:40:00Z",
        }
    )
    assert event is not None
    assert CapacityLines().line(event) == (
        "scale-up failed for pool userpool (ScaleUpTimedOut: no node registered within 15m0s)"
    )


def test_lab_watch_reports_a_recorded_failed_scale_up_in_one_line(tmp_path: Path) -> None:
    """A pod's ``FailedScaleUp`` and the autoscaler's ``ScaleUpFailed`` on its status ConfigMap
    (in kube-system, which ``lab watch`` follows too) each become one line that stays."""
    recorded = {e["reason"]: e for e in _recorded() if e["reason"] != "FailedToScaleUpGroup"}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    failed, instance = (
        {**recorded[reason], "firstTimestamp": stamp, "lastTimestamp": stamp}
        for reason in ("FailedScaleUp", "ScaleUpFailed")
    )
    for kube in serve_kube():
        kube.job = (200, job_manifest(workers=2))
        kube.pods = [pod_manifest(W0, "aks-gpu244695ac-12345678-vmss000000")]
        kube.events = [failed]
        kube.autoscaler_events = [instance]
        stream = io.StringIO()
        code = watch(
            CloudOptions(_outputs(tmp_path, kube), tmp_path / "run"),
            until=_events_logged(tmp_path / "run", 2),
            status=StatusLine(stream, interval_s=0),
        )
        assert code == 1  # nothing was logged to report: the pod never started
    # Each event one line of its own (the status line repeats the newest, as its last event).
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("no Spot")]
    assert sorted(lines) == [
        "no Spot capacity: pool gpu244695ac could not add a node "
        "(OutOfResource.provisioning-state-failed)",
        "no Spot capacity: pool gpu244695ac could not add a node (SkuNotAvailable)",
    ]
    assert kube_seen_kube_system(kube)


def test_a_worker_that_cannot_fit_a_node_is_said_plainly_once() -> None:
    """A node with its GPU free whose CPU the worker's request exceeds (the scheduler counts
    more nodes short of CPU than of GPUs), and the autoscaler's word that a new node would not
    fit it either; a replacement waiting for a GPU, the normal case, says nothing."""
    lines = CapacityLines()
    events = [cluster_event(obj) for obj in json.loads(UNFIT.read_text())["items"]]
    said = [lines.line(event) for event in events if event is not None]
    assert said == [
        None,
        "spotlab-train-worker-2 cannot fit a node with a free GPU: its cpu request is more than "
        "the node has allocatable (4 nodes short of cpu, 3 of nvidia.com/gpu); set workerCpu "
        "and workerMemory lower (docs/azure.md)",
        "spotlab-train-worker-2 cannot fit a new GPU node either: the autoscaler finds its cpu "
        "and memory requests are more than a new node has allocatable; set workerCpu and "
        "workerMemory lower (docs/azure.md)",
    ]
    assert [lines.line(event) for event in events if event is not None] == [None, None, None]


def test_lab_watch_says_a_worker_cannot_fit_instead_of_leaving_it_pending(
    tmp_path: Path,
) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    recorded = json.loads(UNFIT.read_text())["items"]
    events = [{**e, "firstTimestamp": stamp, "lastTimestamp": stamp} for e in recorded]
    for kube in serve_kube():
        kube.job = (200, job_manifest(workers=2))
        kube.pods = [pod_manifest(W0, "aks-gpu244695ac-12345678-vmss000000")]
        kube.events = events
        stream = io.StringIO()
        watch(
            CloudOptions(_outputs(tmp_path, kube), tmp_path / "run"),
            until=_events_logged(tmp_path / "run", len(events)),
            status=StatusLine(stream, interval_s=0),
        )
    # Each a line of its own (the status line repeats the newest, as its last event).
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("spotlab-train")]
    assert [line.split(":", 1)[0] for line in lines] == [
        "spotlab-train-worker-2 cannot fit a node with a free GPU",
        "spotlab-train-worker-2 cannot fit a new GPU node either",
    ]


def kube_seen_kube_system(kube: FakeKube) -> bool:
    """The autoscaler's events were asked for on its status ConfigMap, with the watch API."""
    return any(
        path == "/api/v1/namespaces/kube-system/events"
        and query.get("fieldSelector") == ["involvedObject.name=cluster-autoscaler-status"]
        for _, path, query in kube.seen
    )


def _events_logged(out: Path, count: int) -> Any:
    deadline = time.monotonic() + 20

    def done() -> bool:
        log = out / "events.jsonl"
        logged = log.exists() and len(log.read_text().splitlines()) >= count
        return logged or time.monotonic() > deadline

    return done
