"""``lab rebalance`` against a loopback Kubernetes API server whose job reacts the way a real
one does: the evicted worker gets SIGTERM and saves its step, the survivor re-forms the group
alone, the operator recreates the pod under the same name, the scheduler puts it on a free
Spot node (the on-demand node is cordoned, Spot is preferred), and the group trains at two
again from the step it left."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.azure.cluster.follow import CloudOptions
from lab.azure.cluster.gpu_nodes import GpuNode, Move, Stay, gpu_node, next_move, placements
from lab.azure.cluster.rebalance import RebalanceOptions, rebalance
from lab.live.status_line import StatusLine
from tests.support.cluster_runs import _line, _outputs, metrics_record
from tests.support.kube_replay import (
    NODES_PATH,
    FakeKube,
    job_manifest,
    node_manifest,
    pod_manifest,
)
from tests.support.kube_replay import serve_kube as serve
from tests.support.pod_logs import W0, W1
from training.records import EMERGENCY_SAVE, EVENT, PEER_FAILURE, RESUMED, STARTED

GENERATION = "gpu244695ac"
ON_DEMAND = "aks-ondc0143d44-12345678-vmss000000"
SPOT_1 = "aks-gpu244695ac-12345678-vmss000001"
SPOT_2 = "aks-gpu244695ac-12345678-vmss000002"


def _labels(kind: str) -> dict[str, str]:
    return {"spot-lab/pool": kind, "spot-lab/pool-generation": GENERATION}


class Cluster:
    """Two workers, one on an on-demand node; the job's logs written as time goes on."""

    def __init__(self, kube: FakeKube, spot_ready: bool = True) -> None:
        self.kube = kube
        kube.job = (200, job_manifest(workers=2))
        kube.nodes = [
            node_manifest(ON_DEMAND, _labels("gpu-on-demand")),
            node_manifest(SPOT_1, _labels("gpu-spot")),
            node_manifest(SPOT_2, _labels("gpu-spot"), ready=spot_ready),
        ]
        kube.pods = [pod_manifest(W0, SPOT_1), pod_manifest(W1, ON_DEMAND)]
        kube.on_evict = self.evict
        self.step, self.world, self.version = 0, 2, 100
        self.evicted: list[str] = []
        self.spot_evicted_meanwhile = False
        self._lock = threading.Lock()
        self._stepping = threading.Lock()  # a step and a change of the group never interleave
        self.stop = threading.Event()
        for pod in (W0, W1):
            self._log(pod, kind=EVENT, event=STARTED, max_steps=10_000, global_batch_size=256)
        self._resumed(0, "fresh", 2)
        threading.Thread(target=self._train, daemon=True).start()

    def _log(self, pod: str, **record: Any) -> None:
        with self._lock:
            self.kube.logs[pod] = self.kube.logs.get(pod, "") + _line(time.time(), **record) + "\n"

    def _resumed(self, step: int, source: str, world: int) -> None:
        self._log(W0, kind=EVENT, event=RESUMED, step=step, source=source, world_size=world)

    def _train(self) -> None:
        while not self.stop.wait(0.2):
            with self._stepping:
                self._step()

    def _step(self) -> None:
        if self.world:
            self.step += 1
            self._log(W0, **metrics_record(self.step, self.world))

    def evict(self, pod: str) -> int:
        """The Eviction API: SIGTERM, the emergency save, the pod goes, the group re-forms."""
        with self._stepping:
            return self._evicted(pod)

    def _evicted(self, pod: str) -> int:
        self.evicted.append(pod)
        self._log(pod, kind=EVENT, event=EMERGENCY_SAVE, step=self.step, reason="sigterm")
        self.version += 1
        for manifest in self.kube.pods:
            if manifest["metadata"]["name"] == pod:
                manifest["metadata"]["deletionTimestamp"] = "2026-11-26T00:00:00Z"
                manifest["metadata"]["resourceVersion"] = str(self.version)
        self.world = 0
        self._log(W0, kind=EVENT, event=PEER_FAILURE, step=self.step)
        self._resumed(self.step, "local", 1)
        self.world = 1
        if self.spot_evicted_meanwhile:  # a second fault: the free Spot node is reclaimed
            self.kube.nodes = [n for n in self.kube.nodes if n["metadata"]["name"] != SPOT_2]
        threading.Timer(0.5, self._recreate, args=(pod,)).start()
        return 201

    def _recreate(self, pod: str) -> None:
        """The operator recreates the pod under its name; the scheduler prefers a free Spot
        node, never picks a cordoned one, and keeps the pod pending until a node is free."""
        while not (node := self._free_node()):
            if self.stop.wait(0.1):
                return
        self.version += 1
        self.kube.pods.append(pod_manifest(pod, node, version=str(self.version)))
        self._log(pod, kind=EVENT, event=STARTED, max_steps=10_000, global_batch_size=256)
        with self._stepping:
            self.world = 0
            self._resumed(self.step, "local", 2)
            self.world = 2

    def _free_node(self) -> str | None:
        live = [p for p in self.kube.pods if not p["metadata"].get("deletionTimestamp")]
        busy = {p["spec"]["nodeName"] for p in live}
        free = [
            n["metadata"]["name"]
            for n in self.kube.nodes
            if not n["spec"]["unschedulable"]
            and n["status"]["conditions"][0]["status"] == "True"
            and n["metadata"]["name"] not in busy
        ]
        free.sort(key=lambda name: self._kind(name) != "gpu-spot")
        return free[0] if free else None

    def _kind(self, node: str) -> str:
        return next(
            n["metadata"]["labels"]["spot-lab/pool"]
            for n in self.kube.nodes
            if n["metadata"]["name"] == node
        )


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    yield from serve()


PLAN = RebalanceOptions(spot_timeout_s=20, ready_timeout_s=20, recover_timeout_s=30, poll_s=0.2)


def _run(
    kube: FakeKube, tmp_path: Path, cluster: Cluster, plan: RebalanceOptions = PLAN
) -> tuple[int, str]:
    stream = io.StringIO()
    options = CloudOptions(_outputs(tmp_path, kube), tmp_path / "run", lambda: (0.09, 0.53, "t"))
    try:
        code = rebalance(options, plan, status=StatusLine(stream, interval_s=0))
    finally:
        cluster.stop.set()
    return code, stream.getvalue()


def _placed(kube: FakeKube) -> list[tuple[str, str]]:
    """(pod, node) of the pods that are not being deleted."""
    live = [p for p in kube.pods if not p["metadata"].get("deletionTimestamp")]
    return sorted((p["metadata"]["name"], p["spec"]["nodeName"]) for p in live)


def _events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "rebalance-events.jsonl").read_text().splitlines()]


def test_a_worker_on_demand_moves_to_the_free_spot_node_losing_no_step(
    kube: FakeKube, tmp_path: Path
) -> None:
    cluster = Cluster(kube)
    code, said = _run(kube, tmp_path, cluster)
    assert code == 0, said
    assert cluster.evicted == [W1]
    # Cordoned before the eviction, open again once the move is done.
    patches = [(path, body) for method, path, body in kube.bodies if method == "PATCH"]
    assert patches == [
        (f"{NODES_PATH}/{ON_DEMAND}", {"spec": {"unschedulable": True}}),
        (f"{NODES_PATH}/{ON_DEMAND}", {"spec": {"unschedulable": False}}),
    ]
    evictions = [body for method, _, body in kube.bodies if method == "POST"]
    assert [e["metadata"]["name"] for e in evictions] == [W1]
    assert {e["kind"] for e in evictions} == {"Eviction"}
    assert _placed(kube) == [(W0, SPOT_1), (W1, SPOT_2)]
    out = tmp_path / "run"
    events = _events(out)
    assert [e["event"] for e in events] == [
        "run_started",
        "fault_injected",
        "worker_moved",
        "run_ended",
    ]
    assert (events[2]["pod"], events[2]["node"], events[2]["from_node"]) == (W1, SPOT_2, ON_DEMAND)
    report = json.loads((out / "report.json").read_text())
    (move,) = report["faults"]
    assert (move["kind"], move["recovered"], move["steps_lost"]) == ("move", True, 0)
    assert (move["world_size_before"], move["world_size_after"]) == (2, 2)
    # The drained worker saved the step the group then re-formed at: nothing trained again.
    saved = [
        json.loads(line.split(" ", 1)[1])
        for line in (out / "pods" / f"{W1}.log").read_text().splitlines()
        if '"emergency_save"' in line
    ]
    assert [s["step"] for s in saved] == [move["rounds"][0]["step"]]
    assert [r["world_size"] for r in move["rounds"]] == [1, 2]
    # The pod recreated under its name was followed too: both lives are in its log.
    assert (out / "pods" / f"{W1}.log").read_text().count('"started"') == 2
    assert "done: no worker runs on an on-demand node" in said


def test_the_report_splits_the_hours_and_says_what_the_move_saved(
    kube: FakeKube, tmp_path: Path
) -> None:
    cluster = Cluster(kube)
    code, _ = _run(kube, tmp_path, cluster)
    assert code == 0
    cost = json.loads((tmp_path / "run" / "report.json").read_text())["cost"]
    assert cost["on_demand_node_hours"] > 0 and cost["spot_node_hours"] > 0
    assert cost["gpu_node_hours"] == pytest.approx(
        cost["spot_node_hours"] + cost["on_demand_node_hours"], abs=2e-4
    )
    assert cost["on_demand_usd"] == pytest.approx(cost["on_demand_node_hours"] * 0.53, abs=1e-3)
    (move,) = cost["moves"]
    assert (move["pod"], move["from_node"], move["to_node"]) == (W1, ON_DEMAND, SPOT_2)
    assert move["saves_usd_per_h"] == pytest.approx(0.44)
    assert move["saved_usd"] == pytest.approx(move["spot_hours"] * 0.44, abs=1e-4)
    text = (tmp_path / "run" / "report.txt").read_text()
    assert f"move 0: {W1} back on Spot ({SPOT_2})" in text


def test_a_spot_node_reclaimed_mid_move_sends_the_worker_back_and_stops(
    kube: FakeKube, tmp_path: Path
) -> None:
    """The free Spot node is evicted while the worker drains: no Spot node takes the
    replacement within --spot-timeout, so the on-demand node is opened again, the worker goes
    back there and the group trains at full size; nothing is lost and the run says why."""
    cluster = Cluster(kube)
    cluster.spot_evicted_meanwhile = True
    plan = RebalanceOptions(spot_timeout_s=2, ready_timeout_s=20, recover_timeout_s=30)
    code, said = _run(kube, tmp_path, cluster, plan)
    assert code == 0, said
    assert f"no Spot node took {W1}'s replacement (within 2 s); {ON_DEMAND} is open again" in said
    assert _placed(kube) == [(W0, SPOT_1), (W1, ON_DEMAND)]
    out = tmp_path / "run"
    assert [e["event"] for e in _events(out)] == [
        "run_started",
        "fault_injected",
        "move_abandoned",
        "run_ended",
    ]
    (move,) = json.loads((out / "report.json").read_text())["faults"]
    assert (move["recovered"], move["steps_lost"], move["world_size_after"]) == (True, 0, 2)


def test_with_no_spot_node_ready_it_changes_nothing_and_says_why(
    kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = Cluster(kube, spot_ready=False)
    code, _ = _run(kube, tmp_path, cluster)
    assert code == 0
    assert capsys.readouterr().out.strip() == (
        "nothing to move: every Ready Spot node already runs a worker (1 worker on on-demand)"
    )
    assert cluster.evicted == [] and kube.bodies == []
    assert kube.methods() == {"GET"}
    assert not (tmp_path / "run").exists()


def test_with_no_spot_node_at_all_it_says_the_pool_has_none(
    kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = Cluster(kube)
    kube.nodes = [n for n in kube.nodes if "ond" in n["metadata"]["name"]]
    kube.pods = [pod_manifest(W1, ON_DEMAND)]
    code, _ = _run(kube, tmp_path, cluster)
    assert code == 0
    assert capsys.readouterr().out.strip() == (
        "nothing to move: no Spot node is Ready: the Spot pool has no node (1 worker on on-demand)"
    )
    assert kube.bodies == []


def test_a_pod_recreated_under_its_name_is_followed_again(kube: FakeKube, tmp_path: Path) -> None:
    """The operator recreates an evicted worker under the same name. The follower of the old
    pod ends once that pod is gone; the new one must get its own."""
    from lab.azure.cluster.job_watcher import JobWatcher
    from lab.azure.cluster.recorder import Recorder
    from tests.support.cluster_runs import _cluster

    kube.pods = [pod_manifest(W1, ON_DEMAND)]
    kube.logs = {W1: _line(time.time(), kind=EVENT, event=STARTED, max_steps=9) + "\n"}
    recorder = Recorder(tmp_path)
    watcher = JobWatcher(_cluster(kube), recorder)
    watcher.start()
    try:
        assert _soon(lambda: len(recorder.records) == 1)
        kube.pods[0]["metadata"] |= {
            "deletionTimestamp": "2026-11-26T00:00:00Z",
            "resourceVersion": "11",
        }
        old = next(t for t in watcher._threads if t.name == f"{W1} log")
        assert _soon(lambda: not old.is_alive())  # the old pod is gone: its follower ended
        kube.pods.append(pod_manifest(W1, SPOT_2, version="12"))
        again = _line(time.time(), kind=EVENT, event=STARTED, max_steps=9)
        kube.logs[W1] += again + "\n"
        assert _soon(lambda: len(recorder.records) == 2), "the new pod's log was not followed"
    finally:
        watcher.close()


def _soon(condition: Any, timeout_s: float = 15.0) -> bool:
    """Whether ``condition`` comes true; the bound only ends a test that fails."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---- which worker moves: pure ---------------------------------------------------------------


def _node(name: str, kind: str, generation: str = GENERATION, **state: bool) -> GpuNode:
    return GpuNode(
        name,
        spot=kind == "spot",
        generation=generation,
        ready=state.get("ready", True),
        schedulable=state.get("schedulable", True),
    )


def test_the_next_move_needs_a_free_ready_schedulable_spot_node_of_the_same_generation() -> None:
    on_demand = _node(ON_DEMAND, "on-demand")
    placed = {W0: SPOT_1, W1: ON_DEMAND}
    busy_spot = _node(SPOT_1, "spot")
    assert next_move([on_demand, busy_spot, _node(SPOT_2, "spot")], placed) == Move(
        W1, ON_DEMAND, (SPOT_2,)
    )
    for other in (
        _node(SPOT_2, "spot", ready=False),
        _node(SPOT_2, "spot", schedulable=False),
        _node(SPOT_2, "spot", generation="gpu00000000"),  # an old pool: the job cannot go there
    ):
        decision = next_move([on_demand, busy_spot, other], placed)
        assert isinstance(decision, Stay) and not decision.done, other
    assert next_move([busy_spot], {W0: SPOT_1}) == Stay(
        "no worker runs on an on-demand node: every worker is on Spot", done=True
    )


def test_nodes_and_pods_are_read_from_what_the_api_server_lists() -> None:
    labels = _labels("gpu-spot")
    listed = node_manifest(SPOT_2, labels) | {"spec": {"unschedulable": True}}
    assert gpu_node(listed) == GpuNode(SPOT_2, True, GENERATION, ready=True, schedulable=False)
    system = node_manifest("aks-sys6c853e1f-1-vmss000000", {"spot-lab/pool": "system"})
    assert gpu_node(system) is None
    gone = pod_manifest(W1, ON_DEMAND)
    gone["metadata"]["deletionTimestamp"] = "2026-11-26T00:00:00Z"
    done = pod_manifest("spotlab-train-worker-2", SPOT_2, phase="Failed")
    assert placements([pod_manifest(W0, SPOT_1), gone, done]) == {W0: SPOT_1}


def test_watch_keeps_at_it_until_the_job_ends(kube: FakeKube, tmp_path: Path) -> None:
    cluster = Cluster(kube)
    events = tmp_path / "run" / "rebalance-events.jsonl"

    def end_after_the_move() -> None:  # the job finishes once its worker is back on Spot
        if _soon(lambda: events.exists() and "worker_moved" in events.read_text(), 60):
            kube.job = (200, job_manifest(workers=2, phase="Succeeded"))

    threading.Thread(target=end_after_the_move, daemon=True).start()
    plan = RebalanceOptions(spot_timeout_s=20, ready_timeout_s=20, recover_timeout_s=30)
    plan.watch, plan.poll_s = True, 0.2
    code, said = _run(kube, tmp_path, cluster, plan)
    assert code == 0, said
    assert "the job ended; 1 worker(s) moved to Spot" in said
    assert cluster.evicted == [W1]


@pytest.mark.parametrize(
    "flag", ["--spot-timeout", "--ready-timeout", "--recover-timeout", "--poll"]
)
def test_bad_timeouts_are_refused_before_anything_is_asked(
    flag: str, kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lab.cli import main

    argv = ["rebalance", "--stack-outputs", str(_outputs(tmp_path, kube)), flag, "0"]
    assert main(argv) == 2
    assert flag in capsys.readouterr().err
    assert kube.seen == []
