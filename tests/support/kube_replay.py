"""A Kubernetes API server on loopback that replays recorded answers, so the official client's
own watch, log-streaming and error code runs against it. It also takes the writes of ``lab
rebalance`` and the GPU nodes' agent: a node's cordon (PATCH), a pod's eviction (POST, handed to
a hook) and a pod's delete (DELETE, with its uid precondition), and answers pod lists by their
label and ``spec.nodeName`` field selectors as the API server does.

Watches answer with their recorded events, one JSON object a line, then end the stream the
way the API server does at ``timeoutSeconds``; the client's reconnect (with the last
``resourceVersion``) then gets an empty stream. A log can be cut short on its first request,
to show that a dropped stream is read again and no line is kept twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support.loopback import loopback_server

NS = "spot-lab"
JOB = "spotlab-train"
JOB_PATH = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs/{JOB}"
PODS_PATH = f"/api/v1/namespaces/{NS}/pods"
EVENTS_PATH = f"/api/v1/namespaces/{NS}/events"
NODE_EVENTS_PATH = "/api/v1/namespaces/default/events"
AUTOSCALER_EVENTS_PATH = "/api/v1/namespaces/kube-system/events"
NODES_PATH = "/api/v1/nodes"


@dataclass
class FakeKube:
    url: str = ""
    job: tuple[int, Any] = (200, {})
    pods: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    node_events: list[dict[str, Any]] = field(default_factory=list)
    autoscaler_events: list[dict[str, Any]] = field(default_factory=list)
    """Events on kube-system/cluster-autoscaler-status."""
    logs: dict[str, str] = field(default_factory=dict)
    cut_first_log_at: int | None = None
    """Lines of the first log request before the stream breaks."""
    broken_first_watch: bool = False
    node_events_status: int = 200
    """Anything else: the node event watch is refused with it (RBAC on another namespace)."""
    nodes: list[dict[str, Any]] = field(default_factory=list)
    on_evict: Callable[[str], int] = lambda pod: 201
    """Called with the pod's name on an eviction; returns the status to answer with."""
    bodies: list[tuple[str, str, Any]] = field(default_factory=list)
    """(method, path, JSON body) of every write."""
    seen: list[tuple[str, str, dict[str, list[str]]]] = field(default_factory=list)
    _log_requests: dict[str, int] = field(default_factory=dict)
    _watch_requests: dict[str, int] = field(default_factory=dict)

    def methods(self) -> set[str]:
        return {method for method, _, _ in self.seen}


def job_manifest(workers: int = 3, phase: str = "Running") -> dict[str, Any]:
    """A PyTorchJob (kubeflow.org/v1) as the API server returns it."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": JOB, "namespace": NS, "resourceVersion": "7"},
        "spec": {
            "nprocPerNode": "1",
            "elasticPolicy": {"minReplicas": 1, "maxReplicas": 3},
            "pytorchReplicaSpecs": {"Worker": {"replicas": workers}},
        },
        "status": {
            "conditions": [
                {"type": "Created", "status": "True"},
                {"type": phase, "status": "True"},
            ]
        },
    }


def pod_manifest(name: str, node: str, phase: str = "Running", version: str = "10") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"{name}-{version}",
            "resourceVersion": version,
            "labels": {"training.kubeflow.org/job-name": JOB},
        },
        "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "x"}]},
        "status": {"phase": phase},
    }


def node_manifest(
    name: str, labels: dict[str, str], ready: bool = True, provider_id: str = ""
) -> dict[str, Any]:
    """A Node as the API server lists it: its labels, Ready condition, cordon and VM."""
    spec: dict[str, Any] = {"unschedulable": False}
    if provider_id:
        spec["providerID"] = provider_id
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "resourceVersion": "1"},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _change(obj: dict[str, Any]) -> str:
    """A pod marked deleted (``metadata.deletionTimestamp``) is gone: DELETED, else ADDED."""
    return "DELETED" if (obj.get("metadata") or {}).get("deletionTimestamp") else "ADDED"


def _version(obj: dict[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("resourceVersion") or 0)


def _handler(kube: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _json(self, status: int, body: Any) -> None:
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _stream(self, lines: list[str], pause_s: float = 0.0) -> None:
            # No Content-Length: the body ends when the connection closes, as a watch does.
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.end_headers()
            for line in lines:
                self.wfile.write(line.encode() + b"\n")
                self.wfile.flush()
            time.sleep(pause_s)
            self.close_connection = True

        def _watch(self, path: str, objects: list[dict[str, Any]], query: dict) -> None:
            count = kube._watch_requests[path] = kube._watch_requests.get(path, 0) + 1
            if "resourceVersion" in query:
                # A reconnect: only what changed since that version (nothing, mostly).
                since = int(query["resourceVersion"][0])
                newer = [o for o in objects if _version(o) > since]
                events = [json.dumps({"type": _change(o), "object": o}) for o in newer]
                return self._stream(events, pause_s=0.2)
            if kube.broken_first_watch and count == 1:
                return self._stream(['{"type": "ADDED", "object": {"kind"'])  # torn
            current = [o for o in objects if _change(o) != "DELETED"]
            events = [json.dumps({"type": "ADDED", "object": o}) for o in current]
            return self._stream(events)

        def do_GET(self) -> None:  # noqa: N802
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            kube.seen.append(("GET", url.path, query))
            # The client sends watch=True; the API server parses it as Go's ParseBool does.
            watching = query.get("watch", [""])[0].lower() == "true"
            if url.path == JOB_PATH:
                return self._json(*kube.job)
            if url.path == NODES_PATH and not watching:
                return self._json(200, {"kind": "NodeList", "items": kube.nodes, "metadata": {}})
            if url.path.startswith(NODES_PATH + "/"):
                name = url.path.rsplit("/", 1)[-1]
                node = next((n for n in kube.nodes if n["metadata"]["name"] == name), None)
                return self._json(200, node) if node else self._json(404, _not_found())
            if url.path == PODS_PATH:
                if watching:
                    return self._watch(url.path, kube.pods, query)
                items = [p for p in kube.pods if _selected(p, query)]
                return self._json(200, {"kind": "PodList", "items": items, "metadata": {}})
            if url.path == EVENTS_PATH and watching:
                return self._watch(url.path, kube.events, query)
            if url.path == AUTOSCALER_EVENTS_PATH and watching:
                return self._watch(url.path, kube.autoscaler_events, query)
            if url.path == NODE_EVENTS_PATH and watching:
                if kube.node_events_status != 200:
                    code = kube.node_events_status
                    return self._json(code, {"kind": "Status", "code": code, "reason": "Forbidden"})
                return self._watch(url.path, kube.node_events, query)
            if url.path.startswith(PODS_PATH + "/") and url.path.endswith("/log"):
                pod = url.path.split("/")[-2]
                count = kube._log_requests[pod] = kube._log_requests.get(pod, 0) + 1
                lines = kube.logs.get(pod, "").splitlines()
                if kube.cut_first_log_at is not None and count == 1:
                    lines = lines[: kube.cut_first_log_at]
                return self._stream(lines)
            return self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"null")

        def do_PATCH(self) -> None:  # noqa: N802
            path = urlsplit(self.path).path
            body = self._body()
            kube.seen.append(("PATCH", path, {}))
            kube.bodies.append(("PATCH", path, body))
            for node in kube.nodes:
                if path == f"{NODES_PATH}/{node['metadata']['name']}":
                    node["spec"].update((body or {}).get("spec") or {})
                    return self._json(200, node)
            return self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

        def do_POST(self) -> None:  # noqa: N802
            path = urlsplit(self.path).path
            body = self._body()
            kube.seen.append(("POST", path, {}))
            kube.bodies.append(("POST", path, body))
            if path.startswith(PODS_PATH + "/") and path.endswith("/eviction"):
                code = kube.on_evict(path.split("/")[-2])
                return self._json(code, {"kind": "Status", "code": code})
            return self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

        def do_DELETE(self) -> None:  # noqa: N802
            path = urlsplit(self.path).path
            body = self._body()
            kube.seen.append(("DELETE", path, {}))
            kube.bodies.append(("DELETE", path, body))
            name = path.rsplit("/", 1)[-1]
            pod = next((p for p in kube.pods if p["metadata"]["name"] == name), None)
            if not path.startswith(PODS_PATH + "/") or pod is None:
                return self._json(404, _not_found())
            uid = ((body or {}).get("preconditions") or {}).get("uid")
            if uid and uid != pod["metadata"]["uid"]:
                return self._json(409, {"kind": "Status", "code": 409, "reason": "Conflict"})
            kube.pods.remove(pod)
            return self._json(200, pod)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def _not_found() -> dict[str, Any]:
    return {"kind": "Status", "code": 404, "reason": "NotFound"}


def _selected(pod: dict[str, Any], query: dict[str, list[str]]) -> bool:
    """The API server's ``labelSelector`` (``k=v`` terms) and ``fieldSelector``
    (``spec.nodeName=``) on a pod list."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    for term in ",".join(query.get("labelSelector", [])).split(","):
        key, _, value = term.partition("=")
        if term and labels.get(key) != value:
            return False
    for term in ",".join(query.get("fieldSelector", [])).split(","):
        key, _, value = term.partition("=")
        if key == "spec.nodeName" and (pod.get("spec") or {}).get("nodeName") != value:
            return False
    return True


def serve_kube() -> Iterator[FakeKube]:
    kube = FakeKube()
    with loopback_server(_handler(kube)) as url:
        kube.url = url
        yield kube


def kubeconfig(url: str) -> dict[str, Any]:
    """A kubeconfig for the fake: a bearer token instead of kubelogin, nothing else differs."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "lab", "cluster": {"server": url}}],
        "users": [{"name": "lab", "user": {"token": "test-token"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab"}}],
        "current-context": "lab",
    }
