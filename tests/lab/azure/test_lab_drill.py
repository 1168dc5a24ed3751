"""``lab drill`` against a loopback Kubernetes API server whose job reacts to the eviction the
way a real one does: a worker is SIGTERMed and saves, the others resume at two, and minutes
(here: a second) later a new pod on a new node starts and the group is back at three."""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lab.azure.simulate_eviction
from lab.azure.cluster.cloud_run import CloudOptions, DrillOptions, drill
from lab.azure.cluster.command import evictor
from lab.azure.preflight.command import build_parser as preflight_parser
from lab.azure.prices.command import build_parser as prices_parser
from lab.cli import build_parser
from lab.live.status_line import StatusLine
from tests.support.cluster_runs import REFUSED_OLD, _line, _outputs, metrics_record
from tests.support.kube_replay import FakeKube, job_manifest, pod_manifest, serve_kube
from tests.support.pod_logs import NEW_NODE, W0, W1, W2, k8s_event
from training.records import EMERGENCY_SAVE, EVENT, PEER_FAILURE, RESUMED, STARTED

VICTIM_NODE = "aks-gpu-vmss000002"


def _api_time() -> str:
    """Now, as the API server writes an object's times: whole seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Job:
    """The training job's logs, written as time goes on."""

    def __init__(self, kube: FakeKube, refused_mount_in: Path | None = None) -> None:
        self.kube = kube
        self.refused_mount_in = refused_mount_in
        """The replacement's volume is refused until this run directory has the event."""
        self.step = 0
        self.world = 3
        self.stop = threading.Event()
        self.version = 100
        self._lock = threading.Lock()  # the training thread and the eviction both log
        for pod in (W0, W1, W2):
            self._started(pod)
        self._resumed(0, "fresh", 3)
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()

    def _log(self, pod: str, **record: Any) -> None:
        with self._lock:
            line = _line(time.time(), **record)
            self.kube.logs[pod] = self.kube.logs.get(pod, "") + line + "\n"

    def _started(self, pod: str) -> None:
        self._log(pod, kind=EVENT, event=STARTED, max_steps=10_000, global_batch_size=256)

    def _resumed(self, step: int, source: str, world: int) -> None:
        self._log(W0, kind=EVENT, event=RESUMED, step=step, source=source, world_size=world)

    def _train(self) -> None:
        while not self.stop.wait(0.2):
            if self.world:
                self.step += 1
                self._log(W0, **metrics_record(self.step, self.world))

    def _event(self, reason: str, kind: str, name: str, message: str = "") -> None:
        self.version += 1
        event = k8s_event(0, reason, kind, name, message)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event |= {"firstTimestamp": stamp, "lastTimestamp": stamp}
        event["metadata"]["resourceVersion"] = str(self.version)
        (self.kube.node_events if kind == "Node" else self.kube.events).append(event)

    def _gone(self, pod: str) -> None:
        """The pod is deleted with its node: the pod watch says DELETED."""
        self.version += 1
        for manifest in self.kube.pods:
            if manifest["metadata"]["name"] == pod:
                manifest["metadata"]["deletionTimestamp"] = _api_time()
                manifest["metadata"]["resourceVersion"] = str(self.version)
        self._event("RemovingNode", "Node", VICTIM_NODE, f"Node {VICTIM_NODE} event: Removing")

    def evict(self, node: str) -> int:
        """What the cluster does when the Spot VM behind ``node`` is evicted."""
        self._event("Killing", "Pod", W2, "Stopping container pytorch")
        self._log(W2, kind=EVENT, event=EMERGENCY_SAVE, step=self.step, reason="sigterm")
        self._gone(W2)
        self.world = 0
        self._log(W0, kind=EVENT, event=PEER_FAILURE, step=self.step)
        self._resumed(self.step, "local", 2)
        self.world = 2
        threading.Timer(1.5, self._replace).start()
        return 0

    def _refuse_mount(self, events: Path, times: int = 3) -> None:
        """The kubelet retries the mount until the role applies: here, until the drill has
        recorded ``times`` refusals (a hang guard, not a speed target, bounds the wait)."""
        for _ in range(times):
            self._event("FailedMount", "Pod", W2 + "x", REFUSED_OLD)
        deadline = time.monotonic() + 60
        while not (events.exists() and events.read_text().count('"FailedMount"') >= times):
            assert time.monotonic() < deadline, "the drill never recorded the refusals"
            time.sleep(0.1)

    def _replace(self) -> None:
        self.version += 1
        pod = pod_manifest(W2 + "x", NEW_NODE, phase="Pending", version=str(self.version))
        pod["metadata"]["creationTimestamp"] = _api_time()
        del pod["spec"]["nodeName"]
        self.kube.pods.append(pod)
        self._event("TriggeredScaleUp", "Pod", W2 + "x", "pod triggered scale-up")
        self._event("RegisteredNode", "Node", NEW_NODE, f"Node {NEW_NODE} event: Registered")
        self._event("NodeReady", "Node", NEW_NODE, f"Node {NEW_NODE} status is now: NodeReady")
        self._event("Scheduled", "Pod", W2 + "x", f"Successfully assigned {W2}x to {NEW_NODE}")
        if self.refused_mount_in is not None:
            self._refuse_mount(self.refused_mount_in / "events.jsonl")
        self._event("Pulled", "Pod", W2 + "x", "Successfully pulled image")
        self._event("Started", "Pod", W2 + "x", "Started container pytorch")
        # The pod as the watch sees it next: on its node, its container running (a new
        # object in the list, so a watch that resumes gets both states, as from the server).
        self.version += 1
        status = {
            "name": "pytorch",
            "image": "x",
            "imageID": "",
            "ready": True,
            "restartCount": 0,
            "state": {"running": {"startedAt": _api_time()}},
        }
        running = json.loads(json.dumps(pod))
        running["spec"]["nodeName"] = NEW_NODE
        running["status"] = {"phase": "Running", "containerStatuses": [status]}
        running["metadata"]["resourceVersion"] = str(self.version)
        self.kube.pods.append(running)
        self._started(W2 + "x")
        self.world = 0
        time.sleep(0.3)
        self._resumed(self.step, "local", 3)
        self.world = 3


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    for fake in serve_kube():
        fake.job = (200, job_manifest())
        fake.pods = [
            pod_manifest(W0, "aks-gpu-vmss000000"),
            pod_manifest(W1, "aks-gpu-vmss000001"),
            pod_manifest(W2, VICTIM_NODE),
        ]
        yield fake


PLAN = DrillOptions(evictions=1, interval_s=0, ready_timeout_s=20, recover_timeout_s=30)


def test_a_drill_evicts_one_node_and_reports_the_recovery_and_the_arrival(
    kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(kube)
    evicted: list[str] = []

    def evict(node: str) -> int:
        evicted.append(node)
        return job.evict(node)

    out = tmp_path / "run"
    options = CloudOptions(_outputs(tmp_path, kube), out, lambda: (0.09, 0.53, "test"))
    try:
        code = drill(options, PLAN, evict, status=StatusLine(io.StringIO(), interval_s=0))
    finally:
        job.stop.set()
    assert code == 0
    assert evicted == [VICTIM_NODE]
    drill_log = [json.loads(line) for line in (out / "drill-events.jsonl").read_text().splitlines()]
    assert [r["event"] for r in drill_log] == ["run_started", "fault_injected", "run_ended"]
    report = json.loads((out / "report.json").read_text())
    (fault,) = report["faults"]
    assert (fault["kind"], fault["recovered"], fault["steps_lost"]) == ("evict", True, 0)
    assert (fault["world_size_before"], fault["world_size_after"]) == (3, 2)
    arrival = fault["arrival"]
    assert (arrival["pod"], arrival["node"]) == (W2 + "x", NEW_NODE)
    assert arrival["joined_at"] > arrival["started_at"] > fault["injected_at"]
    assert report["cost"]["spot_usd_per_h"] == 0.09
    assert (out / "report.txt").read_text().count("replacement") == 1
    assert kube.methods() == {"GET"}  # the drill evicts through Azure only
    # The evicted pod's log was read to its last line, its emergency save included.
    assert '"emergency_save"' in (out / "pods" / f"{W2}.log").read_text()
    assert fault["detected_at"] is not None
    # Every step of the replacement, each from the pod watch, an event or the job's log.
    steps = {row["step"]: row for row in fault["replacement_steps"]["steps"]}
    assert [row["source"] for row in steps.values() if row["at"] is None] == []
    assert steps["pod deleted"]["source"] == f"pod watch: {W2} deletionTimestamp"
    assert steps["new pod Pending"]["source"] == f"pod watch: {W2}x creationTimestamp"
    assert steps["node Ready"]["source"] == f"event NodeReady (Node {NEW_NODE})"
    assert steps["container started"]["source"] == f"pod watch: {W2}x state.running.startedAt"
    assert steps["joined"]["source"].startswith(f"job log: {W2}x started")
    assert steps["first step at full size"]["at"] > steps["joined"]["at"] > fault["injected_at"]
    changes = (out / "pod-changes.jsonl").read_text()
    assert changes.count(f'"{W2}x"') == 2  # Pending, then Running on its node: each once
    printed = capsys.readouterr().out
    assert f"fault 0: replacement {W2}x on {NEW_NODE} in " in printed
    assert "  first step at full size " in printed


def test_a_replacement_whose_volume_is_refused_is_said_once_with_the_fix(
    kube: FakeKube, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    job = Job(kube, refused_mount_in=out)
    stream = io.StringIO()
    try:
        options = CloudOptions(_outputs(tmp_path, kube), out)
        code = drill(options, PLAN, job.evict, status=StatusLine(stream, interval_s=0))
    finally:
        job.stop.set()
    assert code == 0
    said = [line for line in stream.getvalue().splitlines() if "FailedMount" in line]
    assert len(said) == 1, said
    assert said[0].startswith(
        f"warning: FailedMount {W2}x: the dataset volume spot-lab-dataset was refused by Blob "
        "Storage: the training identity needs Storage Blob Data Reader on the data container"
    )
    # The kubelet said it three times; the drill once.
    assert (out / "events.jsonl").read_text().count('"FailedMount"') == 3


def test_a_job_that_is_not_running_is_refused(
    kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kube.job = (200, job_manifest(phase="Restarting"))
    options = CloudOptions(_outputs(tmp_path, kube), tmp_path / "run")
    quiet = StatusLine(io.StringIO())
    assert drill(options, PLAN, lambda node: pytest.fail("evicted"), status=quiet) == 1
    assert "the job is Restarting, not Running" in capsys.readouterr().err


def test_outputs_that_cannot_evict_are_refused_before_waiting(
    kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _outputs(tmp_path, kube)
    outputs = json.loads(path.read_text())
    del outputs["gpuPoolName"]
    path.write_text(json.dumps(outputs))
    options = CloudOptions(path, tmp_path / "run")
    quiet = StatusLine(io.StringIO())
    assert drill(options, PLAN, lambda node: pytest.fail("evicted"), status=quiet) == 2
    assert "lacks gpuPoolName" in capsys.readouterr().err
    assert kube.seen == []  # refused before asking the cluster anything


def test_a_job_below_full_size_is_refused_and_nothing_is_evicted(
    kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = Job(kube)
    job.world = 2
    options = CloudOptions(_outputs(tmp_path, kube), tmp_path / "run")
    plan = DrillOptions(1, 0, ready_timeout_s=2, recover_timeout_s=5)
    try:
        quiet = StatusLine(io.StringIO())
        code = drill(options, plan, lambda node: pytest.fail("evicted"), status=quiet)
    finally:
        job.stop.set()
    assert code == 1
    assert "does not train at its full size (world 3) within 2 s" in capsys.readouterr().err


def test_the_cli_evicts_through_simulate_eviction(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(lab.azure.simulate_eviction, "main", lambda argv: calls.append(argv) or 0)
    args = Namespace(stack_outputs=tmp_path / "o.json", subscription="sub-1")
    assert evictor(args)("aks-gpu-vmss000002") == 0
    assert calls == [
        [
            "--stack-outputs",
            str(tmp_path / "o.json"),
            "--node",
            "aks-gpu-vmss000002",
            "--subscription",
            "sub-1",
        ]
    ]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of each command that reads a run or Azure, as ``python -m lab`` builds it."""
    parsers = {"preflight": preflight_parser(), "prices": prices_parser()}
    for action in build_parser()._subparsers._group_actions:  # type: ignore[union-attr]
        if isinstance(action, argparse._SubParsersAction):
            for name in ("watch", "drill", "rebalance", "report"):
                parsers[name] = action.choices[name]
    return parsers


@pytest.mark.parametrize(
    "command", ["preflight", "prices", "watch", "drill", "rebalance", "report"]
)
def test_every_flag_is_explained_and_so_is_the_exit_status(command: str) -> None:
    parser = _parsers()[command]
    for action in parser._actions:
        assert action.help and len(action.help) > 12, f"{command} {action.option_strings}"
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            shown = "%(default)" in action.help or "default" in action.help
            assert shown, f"{command} {action.option_strings}: its default is not said"
    assert "Exit status: 0" in (parser.description or "")


def test_the_drill_evicts_a_worker_on_spot_never_one_on_the_on_demand_fallback() -> None:
    from lab.azure.cluster.cloud_run import _victim

    pods = {
        "spotlab-train-worker-0": "aks-gpu244695ac-12345678-vmss000000",
        "spotlab-train-worker-1": "aks-gpu244695ac-12345678-vmss000001",
        "spotlab-train-worker-2": "aks-ondc0143d44-12345678-vmss000000",
    }
    assert _victim(pods) == ("spotlab-train-worker-1", "aks-gpu244695ac-12345678-vmss000001")
    assert _victim({"spotlab-train-worker-2": "aks-ondc0143d44-12345678-vmss000000"}) is None
