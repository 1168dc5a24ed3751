"""Reaching the job on the cluster: where it is, a client signed in to it, its state.

Built on the official ``kubernetes`` client. It signs in with the stack's own kubeconfig
(``kubeconfig`` in the stack outputs: kubelogin with the Azure CLI's login, as ``pulumi up``
uses it), and turns the client's failures into one line that says what to do. It only reads;
``drain.py`` holds the writes of ``lab rebalance``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import MaxRetryError

from catalog.pool_labels import GPU_KINDS, POOL_LABEL
from workloads.manifests.job import JOB_NAME_LABEL

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"


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

    def _listed(self, what: str, call: Any, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """The items of a list call as plain dicts, or a ``ClusterError`` that says why not."""
        try:
            listed = call(*args, **kwargs)
        except (k8s.ApiException, Urllib3Error, OSError) as err:
            raise explain(err, what) from None
        return [self.api.sanitize_for_serialization(item) for item in listed.items]

    def gpu_nodes(self) -> list[dict[str, Any]]:
        """The nodes of the GPU pools, Spot and on-demand."""
        selector = f"{POOL_LABEL} in ({','.join(GPU_KINDS)})"
        return self._listed("the GPU nodes", self.core.list_node, label_selector=selector)

    def worker_pods(self) -> list[dict[str, Any]]:
        """The job's pods."""
        selector = f"{JOB_NAME_LABEL}={self.target.job}"
        what = f"the pods of {self.target.job} in namespace {self.target.namespace}"
        call = self.core.list_namespaced_pod
        return self._listed(what, call, self.target.namespace, label_selector=selector)

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
