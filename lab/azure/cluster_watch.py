"""Following the PyTorchJob on the cluster: its pods' logs, the cluster's events, a status line.

Built on the official ``kubernetes`` client: the watch API for pods and events, log streaming
for each worker pod. It signs in with the stack's own kubeconfig (``kubeconfig`` in the stack
outputs: kubelogin with the Azure CLI's login, as ``pulumi up`` uses it). It only reads.

What it sees goes to a run directory in the layout ``lab.report.run_logs`` reads (``pods/<pod>.log``
as ``kubectl logs --timestamps`` prints it, ``events.jsonl``), so ``lab watch``, ``lab drill``
and ``lab report --logs`` build one report the same way. A watch or a log stream that drops
is opened again; a log is read again from its start and only new lines are kept.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import MaxRetryError

from lab.live.job_view import JobView
from lab.report.node_logs import parse_record
from lab.report.run_logs import ClusterEvent, cluster_event, well_formed
from workloads.manifests.job import JOB_NAME_LABEL

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
RECONNECT_S = 1.0
# Kubernetes events that tell the user what the cluster does to the job, for the status line.
SHOWN_REASONS = (
    "Scheduled", "Pulled", "Started", "Killing", "Preempting", "Evicted", "TriggeredScaleUp",
    "ScaleDown", "RegisteredNode", "RemovingNode", "NodeNotReady", "FailedScheduling",
)  # fmt: skip


class ClusterError(Exception):
    """An expected failure talking to the cluster; ``str()`` is one line for the user."""


class BadOutputs(ClusterError):
    """The stack outputs file is not one: bad input, nothing was asked of the cluster."""


@dataclass(frozen=True)
class Target:
    """Where the job is, from the stack outputs."""

    kubeconfig: dict[str, Any]
    namespace: str
    job: str


EVICTION_OUTPUTS = ("nodeResourceGroup", "gpuPoolName")
"""What ``simulate-eviction`` reads from the outputs, so ``lab drill`` needs it too."""


def read_target(path: Path, also: tuple[str, ...] = ()) -> Target:
    """The cluster, namespace and job named by ``pulumi stack output --json --show-secrets``;
    ``also``: other outputs the caller needs, checked here so a run does not start without."""
    write = "write it with `pulumi stack output --json --show-secrets > FILE`"
    try:
        outputs = json.loads(path.read_text())
    except OSError as err:
        raise BadOutputs(
            f"--stack-outputs {path}: cannot read it ({err.strerror}); {write}"
        ) from None
    except ValueError as err:
        raise BadOutputs(f"--stack-outputs {path}: not JSON ({err}); {write}") from None
    if not isinstance(outputs, dict):
        raise BadOutputs(f"--stack-outputs {path} must hold a JSON object of stack outputs")
    missing = [k for k in ("kubeconfig", "namespace", "jobName", *also) if not outputs.get(k)]
    if missing:
        raise BadOutputs(
            f"--stack-outputs {path} lacks {', '.join(missing)}: was it written with "
            "--show-secrets, from a stack that is up?"
        )
    kubeconfig = outputs["kubeconfig"]
    try:
        config = yaml.safe_load(kubeconfig) if isinstance(kubeconfig, str) else kubeconfig
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1})" if where else ""
        raise BadOutputs(f"--stack-outputs {path}: its kubeconfig is not YAML{line}") from None
    if not isinstance(config, dict):
        raise BadOutputs(f"--stack-outputs {path}: its kubeconfig is not a kubeconfig")
    return Target(config, str(outputs["namespace"]), str(outputs["jobName"]))


def _unreachable(err: Exception) -> str:
    """Why a request never got an answer, in a few words (urllib3 nests the OS error)."""
    reason = err.reason if isinstance(err, MaxRetryError) and err.reason else err
    text = str(reason)
    found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if found:
        return found.group(1).strip()
    return text.split(": ", 1)[-1].strip() or type(reason).__name__


def explain(err: Exception, what: str) -> ClusterError:
    """A client error as one line that says what to do."""
    if isinstance(err, k8s.ApiException):
        if err.status == 401:
            return ClusterError(
                f"the cluster refused the sign-in reading {what} (401): the kubeconfig's "
                "token expired or is not valid; run `az login` again (kubelogin uses it)"
            )
        if err.status == 403:
            return ClusterError(
                f"not allowed to read {what} (403, Kubernetes RBAC): the signed-in identity "
                "needs a role on the cluster, such as the one `pulumi up` gave its deployer"
            )
        if err.status == 404:
            return ClusterError(f"{what} not found (404): is the stack up, the job created?")
        return ClusterError(f"reading {what} failed: {err.status} {err.reason}")
    return ClusterError(f"cannot reach the cluster reading {what}: {_unreachable(err)}")


def _exec_command(kubeconfig: dict[str, Any]) -> dict[str, Any] | None:
    """The exec credential plugin of the kubeconfig's current user, if it signs in with one."""
    contexts = {c.get("name"): c.get("context") or {} for c in kubeconfig.get("contexts") or []}
    users = {u.get("name"): u.get("user") or {} for u in kubeconfig.get("users") or []}
    context = contexts.get(kubeconfig.get("current-context")) or {}
    plugin = users.get(context.get("user"), {}).get("exec")
    return plugin if isinstance(plugin, dict) and plugin.get("command") else None


class _Said(logging.Filter):
    """Keeps what the kubernetes client logs on the root logger instead of printing it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.lines.append(" ".join(record.getMessage().split()))
        return False


@contextmanager
def _root_log_kept() -> Iterator[_Said]:
    # The client reports a failed sign-in plugin with ``logging.error`` and goes on without a
    # credential; that call would also install a root handler that prints urllib3's retries.
    root = logging.getLogger()
    said, placeholder = _Said(), logging.NullHandler()
    root.addFilter(said)
    root.addHandler(placeholder)
    try:
        yield said
    finally:
        root.removeFilter(said)
        root.removeHandler(placeholder)


class Cluster:
    """Read-only access to the job's objects."""

    def __init__(self, target: Target, api: k8s.ApiClient | None = None) -> None:
        self.target = target
        if api is None:
            api = self._client(target.kubeconfig)
        self.api = api
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)

    @staticmethod
    def _client(kubeconfig: dict[str, Any]) -> k8s.ApiClient:
        """A client for the kubeconfig; its sign-in plugin runs here, and fails here."""
        plugin = _exec_command(kubeconfig)
        if plugin is not None and shutil.which(str(plugin["command"])) is None:
            hint = plugin.get("installHint") or f"install {plugin['command']}"
            raise ClusterError(
                f"the stack's kubeconfig signs in with {plugin['command']}, which is not on "
                f"PATH: {' '.join(str(hint).split())}"
            )
        with _root_log_kept() as said:
            try:
                api = k8s_config.new_client_from_config_dict(kubeconfig)
            except (k8s_config.ConfigException, ValueError, KeyError, TypeError) as err:
                raise ClusterError(f"the stack's kubeconfig is not usable: {err}") from None
        if said.lines:
            uses_az = plugin is not None and "kubelogin" in str(plugin["command"])
            hint = ": is `az login` current? kubelogin signs in with it" if uses_az else ""
            raise ClusterError(
                f"signing in to the cluster failed ({'; '.join(said.lines)[:300]}){hint}"
            )
        return api

    def job(self) -> dict[str, Any]:
        what = f"PyTorchJob {self.target.job} in namespace {self.target.namespace}"
        try:
            return self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.target.namespace, PLURAL, self.target.job
            )
        except (k8s.ApiException, Urllib3Error, OSError) as err:
            raise explain(err, what) from None


def job_phase(job: dict[str, Any]) -> str:
    """The newest true condition of the job (Created, Running, Restarting, Succeeded...)."""
    status = job.get("status") or {}
    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    return conditions[-1]["type"] if conditions else "Pending"


def procs_per_worker(job: dict[str, Any]) -> int:
    """Training processes in one worker pod (``nprocPerNode``: one per GPU in our job)."""
    spec = job.get("spec") or {}
    value = str(spec.get("nprocPerNode") or (spec.get("elasticPolicy") or {}).get("nProcPerNode"))
    return int(value) if value.isdigit() and int(value) > 0 else 1


def full_world_size(job: dict[str, Any]) -> int:
    """Workers the job asks for × processes per worker: the world at full size."""
    spec = job.get("spec") or {}
    workers = ((spec.get("pytorchReplicaSpecs") or {}).get("Worker") or {}).get("replicas") or 1
    return int(workers) * procs_per_worker(job)


@dataclass
class Recorder:
    """Everything seen, written to the run directory as it arrives, and the live picture."""

    out: Path
    view: JobView = field(default_factory=JobView)
    pods: dict[str, str] = field(default_factory=dict)
    """pod -> node."""
    last_cluster_event: str = "-"
    records: list[dict[str, Any]] = field(default_factory=list)
    _seen: dict[str, set[str]] = field(default_factory=dict)
    _newest: float = 0.0
    _events_seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        (self.out / "pods").mkdir(parents=True, exist_ok=True)

    def log_line(self, pod: str, line: str) -> bool:
        """Keep one line of a pod's log unless a reconnect delivered it before."""
        line = line.rstrip("\n")
        with self._lock:
            seen = self._seen.setdefault(pod, set())
            if not line or line in seen:
                return False
            seen.add(line)
            with open(self.out / "pods" / f"{pod}.log", "a") as handle:
                handle.write(line + "\n")
            stamped = line.split(" ", 1)
            record = parse_record(stamped[-1], pod)
            if record is not None and well_formed(record):
                self.records.append(record)
                # Each pod's log streams on its own: the picture follows the newest record.
                if record["ts"] >= self._newest:
                    self._newest = record["ts"]
                    self.view.observe(record)
        return True

    def cluster_event(self, obj: dict[str, Any]) -> ClusterEvent | None:
        """Keep an Event once: a new watch lists every existing one again."""
        meta = obj.get("metadata") or {}
        identity = ("namespace", "name", "resourceVersion")
        key = json.dumps(
            [meta.get(k) for k in identity] + [obj.get(k) for k in ("count", "lastTimestamp")]
        )
        event = cluster_event(obj)
        with self._lock:
            if key in self._events_seen:
                return None
            self._events_seen.add(key)
            with open(self.out / "events.jsonl", "a") as handle:
                handle.write(json.dumps(obj) + "\n")
            if event is not None and event.reason in SHOWN_REASONS:
                self.last_cluster_event = f"{event.reason} {event.kind.lower()} {event.name}"
        return event

    def status(self, phase: str, max_steps: int | None) -> str:
        view = self.view
        loss = "-" if view.loss is None else f"{view.loss:.4f}"
        pods = ", ".join(f"{p}@{n or '?'}" for p, n in sorted(self.pods.items())) or "no pods"
        rate = next(
            (f"{r['samples_per_s']:.0f}" for r in reversed(self.records) if "samples_per_s" in r),
            "-",
        )
        return (
            f"{phase} | {pods} | world {view.world_size} | step {view.step}/{max_steps or '?'} | "
            f"loss {loss} | {rate} samples/s | {view.last_event} | {self.last_cluster_event}"
        )


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
        self._following: set[str] = set()
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
        self._start("pod watch", self._watch_pods)
        self._start("event watch", self._watch_events)
        self._start("node event watch", self._watch_node_events)

    def _watch_pods(self) -> bool:
        target = self.cluster.target
        watcher = k8s_watch.Watch()
        stream = watcher.stream(
            self.cluster.core.list_namespaced_pod,
            target.namespace,
            label_selector=f"{JOB_NAME_LABEL}={target.job}",
            timeout_seconds=300,
        )
        for event in _until(stream, self.stop, watcher):
            pod = event["object"]
            name = pod.metadata.name
            self.recorder.pods[name] = pod.spec.node_name if pod.spec else None
            if event["type"] == "DELETED":
                self.recorder.pods.pop(name, None)
            elif name not in self._following and pod.status and pod.status.phase != "Pending":
                self._following.add(name)
                self._start(f"{name} log", lambda name=name: self._follow_log(name))
        return False

    def _follow_log(self, pod: str) -> bool:
        """Stream a pod's log from its start; done once the pod is gone and read to the end."""
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
        return pod not in self.recorder.pods

    def _watch_events(self) -> bool:
        watcher = k8s_watch.Watch()
        stream = watcher.stream(
            self.cluster.core.list_namespaced_event,
            self.cluster.target.namespace,
            timeout_seconds=300,
        )
        for event in _until(stream, self.stop, watcher):
            self.recorder.cluster_event(self._plain(event["object"]))
        return False

    def _plain(self, obj: Any) -> dict[str, Any]:
        return self.cluster.api.sanitize_for_serialization(obj)

    def _watch_node_events(self) -> bool:
        # Node events (registered, removed, not ready) live in the default namespace.
        watcher = k8s_watch.Watch()
        stream = watcher.stream(
            self.cluster.core.list_namespaced_event,
            "default",
            field_selector="involvedObject.kind=Node",
            timeout_seconds=300,
        )
        for event in _until(stream, self.stop, watcher):
            self.recorder.cluster_event(self._plain(event["object"]))
        return False

    def close(self) -> None:
        self.stop.set()


def _until(stream: Iterator[Any], stop: threading.Event, watcher: k8s_watch.Watch) -> Iterator[Any]:
    for event in stream:
        if stop.is_set():
            watcher.stop()
            return
        yield event
