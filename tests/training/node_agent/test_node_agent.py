"""The GPU node's agent against recorded Scheduled Events documents (Azure's documented JSON,
served on loopback with the API's own checks: the ``Metadata: true`` header and the
api-version) and a loopback Kubernetes API, through the official client: what it deletes, how,
and what it cordons, for a Preempt of its own VM, of another VM, and for no event."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client

from tests.support.azure_replay import recording
from tests.support.kube_replay import NS, FakeKube, node_manifest, pod_manifest, serve_kube
from tests.support.loopback import loopback_server, reply
from training.node_agent import agent as node_agent
from training.node_agent.agent import NodeAgent, run
from training.node_agent.cluster import Cluster
from training.node_agent.scheduled_events import (
    API_VERSION,
    fetch,
    own_preempt,
    parse,
    started_preempts,
    vm_name,
)

SCALE_SET = "aks-gpu244695ac-12345678-vmss"
THIS_NODE, OTHER_NODE = f"{SCALE_SET}000003", f"{SCALE_SET}000005"
THIS_VM, OTHER_VM = f"{SCALE_SET}_3", f"{SCALE_SET}_5"
WORKERS = "spot-lab/role=trainer"
NOT_BEFORE = datetime(2026, 12, 2, 15, 30, 30, tzinfo=UTC)  # the recordings' NotBefore


def _provider_id(instance: int) -> str:
    return (
        "azure:///subscriptions/00000000-0000-0000-0000-00000000abcd/resourceGroups/"
        f"mc_spotlab-dev_spotlab-dev_westus3/providers/Microsoft.Compute/"
        f"virtualMachineScaleSets/{SCALE_SET}/virtualMachines/{instance}"
    )


class Imds:
    """Scheduled Events on loopback: one recorded document, and every request seen."""

    def __init__(self) -> None:
        self.document: Any = recording("scheduled_events_empty.json")
        self.status = 200
        self.seen: list[tuple[str, dict[str, list[str]], str | None]] = []


def _imds_handler(imds: Imds) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            imds.seen.append((self.command, query, self.headers.get("Metadata")))
            # The service's own refusals: no Metadata header, or no (known) api-version.
            if self.headers.get("Metadata") != "true" or query.get("api-version") != [API_VERSION]:
                return reply(self, 400, b'{"error": "Bad request"}', {})
            if url.path != "/metadata/scheduledevents":
                return reply(self, 404, b"{}", {})
            body = json.dumps(imds.document).encode()
            return reply(self, imds.status, body, {"Content-Type": "application/json"})

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def imds() -> Iterator[tuple[Imds, str]]:
    fake = Imds()
    with loopback_server(_imds_handler(fake)) as url:
        yield fake, url


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    for fake in serve_kube():
        labels = {"spot-lab/pool": "gpu-spot"}
        fake.nodes = [
            node_manifest(THIS_NODE, labels, provider_id=_provider_id(3)),
            node_manifest(OTHER_NODE, labels, provider_id=_provider_id(5)),
        ]
        fake.pods = [
            _worker("spotlab-train-worker-2", THIS_NODE),
            _worker("spotlab-train-worker-0", OTHER_NODE),
            pod_manifest("etcd-0", "aks-sys6c853e1f-12345678-vmss000000"),
        ]
        yield fake


def _worker(name: str, node: str) -> dict[str, Any]:
    pod = pod_manifest(name, node)
    pod["metadata"]["labels"]["spot-lab/role"] = "trainer"
    return pod


def _cluster(kube: FakeKube) -> Cluster:
    config = client.Configuration(host=kube.url, api_key={"authorization": "Bearer test-token"})
    return Cluster(client.CoreV1Api(client.ApiClient(config)), NS, WORKERS)


def _agent(kube: FakeKube, imds: tuple[Imds, str], now: datetime) -> NodeAgent:
    clock = {"now": now}
    agent = NodeAgent(_cluster(kube), THIS_NODE, THIS_VM, lambda: fetch(imds[1]))
    agent.clock = lambda: clock["now"]
    return agent


def _writes(kube: FakeKube) -> list[tuple[str, str, Any]]:
    return [(m, p, b) for m, p, b in kube.bodies]


def test_a_preempt_of_this_vm_evicts_its_workers_gracefully_then_cordons_in_one_poll(
    kube: FakeKube, imds: tuple[Imds, str]
) -> None:
    imds[0].document = recording("scheduled_events_preempt_this_vm.json")
    agent = _agent(kube, imds, NOT_BEFORE - timedelta(seconds=29))
    assert agent.vm == _cluster(kube).vm_of(THIS_NODE) == THIS_VM
    agent.poll()
    (delete, cordon) = _writes(kube)
    assert delete[:2] == ("DELETE", f"/api/v1/namespaces/{NS}/pods/spotlab-train-worker-2")
    # Graceful: no gracePeriodSeconds, so the pod's own 28 s (SIGTERM, the stop deadline); the
    # uid precondition spares a replacement that took the name.
    assert delete[2].get("gracePeriodSeconds") is None
    assert delete[2]["preconditions"] == {"uid": "spotlab-train-worker-2-10"}
    assert cordon == ("PATCH", f"/api/v1/nodes/{THIS_NODE}", {"spec": {"unschedulable": True}})
    # The other node's worker and the non-worker pod are untouched.
    assert {p["metadata"]["name"] for p in kube.pods} == {"spotlab-train-worker-0", "etcd-0"}
    agent.poll()  # the same event: evicted once
    assert len(_writes(kube)) == 2
    # Never acknowledged: only GETs reached the metadata service, each with its header.
    assert {(method, header) for method, _, header in imds[0].seen} == {("GET", "true")}


def test_a_preempt_of_another_vm_is_left_until_its_not_before_then_its_workers_go(
    kube: FakeKube, imds: tuple[Imds, str]
) -> None:
    """Events of every VM of the placement group reach every VM. Before NotBefore the other
    VM's own agent evicts its workers; past it that VM is being deleted, so whatever worker is
    still bound there is force-deleted and the operator recreates it at once."""
    imds[0].document = recording("scheduled_events_preempt_other_vm.json")
    clock = {"now": NOT_BEFORE - timedelta(seconds=20)}
    agent = _agent(kube, imds, clock["now"])
    agent.clock = lambda: clock["now"]
    agent.poll()
    assert _writes(kube) == []
    clock["now"] = NOT_BEFORE + timedelta(seconds=1)
    agent.poll()
    (delete,) = _writes(kube)
    assert delete[1] == f"/api/v1/namespaces/{NS}/pods/spotlab-train-worker-0"
    assert delete[2]["gracePeriodSeconds"] == 0
    assert delete[2]["preconditions"] == {"uid": "spotlab-train-worker-0-10"}
    agent.poll()
    assert len(_writes(kube)) == 1  # this node is not cordoned, nothing is deleted twice


def test_an_empty_document_changes_nothing(kube: FakeKube, imds: tuple[Imds, str]) -> None:
    agent = _agent(kube, imds, NOT_BEFORE)
    for _ in range(3):
        agent.poll()
    assert _writes(kube) == [] and len(kube.pods) == 3
    assert [method for method, _, _ in imds[0].seen] == ["GET"] * 3


def test_a_worker_whose_node_is_gone_is_force_deleted(
    kube: FakeKube, imds: tuple[Imds, str]
) -> None:
    """The cloud node manager deletes the Node of a VM that is gone; the pod garbage collector
    would wait 40 s more. Checked every ORPHANS_EVERY polls."""
    kube.pods.append(_worker("spotlab-train-worker-1", f"{SCALE_SET}000007"))
    agent = _agent(kube, imds, NOT_BEFORE)
    for _ in range(node_agent.ORPHANS_EVERY):
        agent.poll()
    (delete,) = _writes(kube)
    assert delete[1].endswith("/pods/spotlab-train-worker-1")
    assert delete[2]["gracePeriodSeconds"] == 0


def test_a_failed_poll_is_logged_and_the_next_one_runs(
    kube: FakeKube, imds: tuple[Imds, str], caplog: pytest.LogCaptureFixture
) -> None:
    imds[0].status = 503
    agent = _agent(kube, imds, NOT_BEFORE)
    polls: list[int] = []

    def stop() -> bool:
        polls.append(1)
        if len(polls) == 2:
            imds[0].status = 200
            imds[0].document = recording("scheduled_events_preempt_this_vm.json")
        return len(polls) > 2

    run(agent, stop, lambda seconds: None)
    assert "poll failed" in caplog.text
    assert any(m == "PATCH" for m, _, _ in kube.bodies)  # the second poll acted


def test_the_documented_shape_parses_and_a_stranger_does_not() -> None:
    incarnation, events = parse(recording("scheduled_events_preempt_this_vm.json"))
    assert incarnation == 2
    (event,) = events
    assert (event.event_type, event.resources, event.not_before) == (
        "Preempt",
        (THIS_VM,),
        NOT_BEFORE,
    )
    assert own_preempt(events, THIS_VM) is event and own_preempt(events, OTHER_VM) is None
    assert started_preempts(events, NOT_BEFORE - timedelta(seconds=1)) == []
    assert started_preempts(events, NOT_BEFORE) == [event]
    started = {**recording("scheduled_events_preempt_this_vm.json")["Events"][0]}
    started.update(EventStatus="Started", NotBefore="")  # blank once started
    (running,) = parse({"DocumentIncarnation": 3, "Events": [started]})[1]
    assert running.not_before is None and running.started_by(NOT_BEFORE - timedelta(days=1))
    for bad in ({}, {"DocumentIncarnation": 1, "Events": [{"EventId": "x"}]}):
        with pytest.raises(ValueError, match="not a Scheduled Events"):
            parse(bad)


def test_a_nodes_vm_is_named_as_scheduled_events_names_it() -> None:
    assert vm_name(_provider_id(3)) == THIS_VM
    vm = (
        _provider_id(3).split("/providers/")[0] + "/providers/Microsoft.Compute/virtualMachines/vm1"
    )
    assert vm_name(vm) == "vm1"
    assert vm_name("kind://docker/kind/kind-worker") is None
