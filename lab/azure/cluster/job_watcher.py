"""Following the job's pods, their logs and the cluster's events, each in a thread of its own.

The watch API for pods and events (the job's namespace, the nodes', and the cluster
autoscaler's on its status ConfigMap in ``kube-system``), log streaming for each worker pod.
What arrives goes to a ``Recorder``. A watch or a log stream that drops is opened again; a log
is read again from its start and the recorder keeps only new lines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from urllib3.exceptions import HTTPError as Urllib3Error

from lab.azure.cluster.kube import Cluster, explain
from lab.azure.cluster.recorder import Recorder
from workloads.manifests.job import JOB_NAME_LABEL

RECONNECT_S = 1.0
AUTOSCALER_STATUS = ("kube-system", "cluster-autoscaler-status")
"""Where the cluster autoscaler records scale-ups that failed or timed out (its
``LogEventRecorder``, kubernetes/autoscaler ``clusterstate/utils/status.go``)."""


def _forever(
    stop: threading.Event, body: Callable[[], bool], dropped: Callable[[Exception], None]
) -> None:
    """Run ``body`` until ``stop`` or until it says it is done; a dropped stream or a failed
    request is reported to ``dropped`` and opened again."""
    while not stop.is_set():
        try:
            if body():
                return
        # A stream cut mid-object fails in the client's decoding (ValueError, TypeError) as
        # well as in the connection: either way, open it again.
        except (k8s.ApiException, Urllib3Error, OSError, ValueError, TypeError) as err:
            if not stop.is_set():
                dropped(err)
        stop.wait(RECONNECT_S)


class JobWatcher:
    """Threads that follow the job's pods, their logs and the cluster's events."""

    def __init__(self, cluster: Cluster, recorder: Recorder) -> None:
        self.cluster = cluster
        self.recorder = recorder
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._following: set[tuple[str, str]] = set()
        """(pod, uid) of every pod whose log is followed."""
        self._uids: dict[str, str] = {}
        """pod -> uid of the pod of that name now."""
        self._pods_seen: str | None = None
        """The resourceVersion the pod watch resumes from."""
        self._notices: list[str] = []
        self._lock = threading.Lock()

    def notices(self) -> list[str]:
        """What went wrong since the last call: each dropped stream, once."""
        with self._lock:
            taken, self._notices = self._notices, []
        return taken

    def _start(self, name: str, body: Callable[[], bool]) -> None:
        said: list[str] = []

        def dropped(err: Exception) -> None:
            reason = explain(err, name) if isinstance(err, k8s.ApiException) else err
            notice = f"the {name} stream dropped ({reason}); opening it again"
            if said[-1:] != [notice]:  # a refusal that lasts is said once, not every second
                said.append(notice)
                with self._lock:
                    self._notices.append(notice)

        args = (self.stop, body, dropped)
        thread = threading.Thread(target=_forever, args=args, daemon=True, name=name)
        thread.start()
        self._threads.append(thread)

    def start(self) -> None:
        namespace, status = AUTOSCALER_STATUS
        self._start("pod watch", self._watch_pods)
        self._start("event watch", lambda: self._watch_events(self.cluster.target.namespace))
        # Node events (registered, removed, not ready) live in the default namespace.
        self._start(
            "node event watch", lambda: self._watch_events("default", "involvedObject.kind=Node")
        )
        self._start(
            "autoscaler event watch",
            lambda: self._watch_events(namespace, f"involvedObject.name={status}"),
        )

    def _watch_pods(self) -> bool:
        target = self.cluster.target
        watcher = k8s_watch.Watch()
        # Resumed from the last change seen, so a pod deleted between two watches is seen too.
        since = {"resource_version": self._pods_seen} if self._pods_seen else {}
        stream = watcher.stream(
            self.cluster.core.list_namespaced_pod,
            target.namespace,
            label_selector=f"{JOB_NAME_LABEL}={target.job}",
            timeout_seconds=300,
            **since,
        )
        try:
            for event in _until(stream, self.stop, watcher):
                self._pod_event(event["type"], event["object"])
        except k8s.ApiException as err:
            # 410 Gone: the version is too old to resume from; the next watch lists afresh.
            self._pods_seen = None if err.status == 410 else watcher.resource_version
            raise
        self._pods_seen = watcher.resource_version
        return False

    def _pod_event(self, change: str, pod: Any) -> None:
        """Record a pod's node; follow the log of each pod that runs, once per pod, a pod the
        operator recreated under the same name included (a new uid)."""
        name = pod.metadata.name
        uid = pod.metadata.uid or name
        self.recorder.place(name, pod.spec.node_name if pod.spec else None)
        self.recorder.pod_changed(change, self._plain(pod))
        if change == "DELETED":
            self.recorder.pods.pop(name, None)
            if self._uids.get(name) == uid:
                del self._uids[name]
            return
        self._uids[name] = uid
        running = pod.status is not None and pod.status.phase != "Pending"
        if running and (name, uid) not in self._following:
            self._following.add((name, uid))
            self._start(f"{name} log", lambda: self._follow_log(name, uid))

    def _follow_log(self, pod: str, uid: str) -> bool:
        """Stream a pod's log from its start; done once that pod (``uid``) is gone or replaced
        and its log read to the end."""
        response = self.cluster.core.read_namespaced_pod_log(
            pod,
            self.cluster.target.namespace,
            follow=True,
            timestamps=True,
            _preload_content=False,
        )
        try:
            pending = b""
            for chunk in response.stream(4096):
                if self.stop.is_set():
                    return True
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self.recorder.log_line(pod, line.decode("utf-8", errors="replace"))
        finally:
            response.release_conn()
        return self._uids.get(pod) != uid

    def _watch_events(self, namespace: str, field_selector: str = "") -> bool:
        watcher = k8s_watch.Watch()
        stream = watcher.stream(
            self.cluster.core.list_namespaced_event,
            namespace,
            **({"field_selector": field_selector} if field_selector else {}),
            timeout_seconds=300,
        )
        for event in _until(stream, self.stop, watcher):
            self.recorder.cluster_event(self._plain(event["object"]))
        return False

    def _plain(self, obj: Any) -> dict[str, Any]:
        return self.cluster.api.sanitize_for_serialization(obj)

    def close(self) -> None:
        self.stop.set()


def _until(stream: Iterator[Any], stop: threading.Event, watcher: k8s_watch.Watch) -> Iterator[Any]:
    for event in stream:
        if stop.is_set():
            watcher.stop()
            return
        yield event
