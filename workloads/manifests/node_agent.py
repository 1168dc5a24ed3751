"""The GPU nodes' agent: a DaemonSet that turns Azure's eviction notice into the workers' SIGTERM.

It runs ``python -m training.node_agent`` (``training/node_agent/``) from the training image,
which every GPU node pulls for its worker anyway: no other image, no other registry. It is ours
rather than a maintained termination handler because the lab needs two things those do not do:
force-deleting the worker pods of a VM that is gone, on the notice of another VM of the scale
set's placement group (the handler in AKS's docs' ecosystem, maksim-paskal/aks-node-termination-
handler, drains only its own node, ``pkg/events/events.go``), and touching only the workers.

Its place: the lab's namespace, whose Pod Security ``baseline`` it meets (no hostNetwork, no
hostPath, no added capability: a pod reaches the instance metadata address from the pod network,
which is why the other pods' egress policies except it). Its own NetworkPolicy admits exactly
the metadata service (port 80) and HTTPS (the API server); no other pod of the namespace may
reach the metadata address (``workloads/manifests/namespace.py``). Pure: builds plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workloads.manifests.namespace import IMDS_CIDR, NODE_AGENT_ROLE
from workloads.manifests.scheduling import (
    GPU_SPOT_POOL,
    ROLE_LABEL,
    TRAINER_LABELS,
    gpu_spot_tolerations,
)

NODE_AGENT_LABELS = {ROLE_LABEL: NODE_AGENT_ROLE}
NAME = "node-agent"
IMDS_PORT = 80
HTTPS_PORT = 443
# AKS's node auto-drain taints a node it drains on a Scheduled Event (AKS, "Node auto-drain":
# "may receive a taint with remediator.kubernetes.azure.com/unschedulable"); the agent must stay.
REMEDIATOR_TOLERATION: dict[str, Any] = {
    "key": "remediator.kubernetes.azure.com/unschedulable",
    "operator": "Exists",
}


@dataclass(frozen=True)
class NodeAgentSpec:
    """Where the agent runs and which pods are the workers it evicts."""

    namespace: str
    image: str
    """The training image (content-hash tag): the agent's code is in ``training/``."""
    priority_class: str
    """Above the workers': a node under pressure evicts a worker before its agent."""
    node_selector: dict[str, str] = field(default_factory=lambda: dict(GPU_SPOT_POOL))
    affinity: dict[str, Any] | None = None
    """With the on-demand fallback: either GPU pool (``any_gpu_pool``), as the device plugin."""
    worker_labels: dict[str, str] = field(default_factory=lambda: dict(TRAINER_LABELS))

    def validate(self) -> None:
        if not self.image or ":" not in self.image.rsplit("/", 1)[-1]:
            raise ValueError(f"image must carry an explicit tag, got {self.image!r}")

    @property
    def worker_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.worker_labels.items()))


def node_agent_command(spec: NodeAgentSpec) -> list[str]:
    return ["python", "-m", "training.node_agent", f"--worker-selector={spec.worker_selector}"]


def _container(spec: NodeAgentSpec) -> dict[str, Any]:
    def field_env(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return {
        "name": NAME,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": node_agent_command(spec),
        "env": [
            field_env("NODE_NAME", "spec.nodeName"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
        ],
        # Python and the Kubernetes client: well inside the DaemonSets' reserve that the
        # workers' requests leave (catalog/gpu_sizes.py, DAEMONSET_CPU_MILLIS and _MEMORY_MIB).
        "resources": {
            "requests": {"cpu": "50m", "memory": "128Mi"},
            "limits": {"memory": "256Mi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def node_agent_daemonset(spec: NodeAgentSpec) -> dict[str, Any]:
    """One agent on every GPU node."""
    spec.validate()
    labels = dict(NODE_AGENT_LABELS)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": NAME,
        "priorityClassName": spec.priority_class,
        **({"nodeSelector": dict(spec.node_selector)} if spec.node_selector else {}),
        **({"affinity": spec.affinity} if spec.affinity else {}),
        # The GPU pools' taints, and AKS's drain taint; a DaemonSet's pods tolerate not-ready,
        # unreachable and unschedulable by themselves (Kubernetes, DaemonSet, "Taints and
        # tolerations").
        "tolerations": [*gpu_spot_tolerations(), dict(REMEDIATOR_TOLERATION)],
        # SIGTERM ends its loop at once: it holds nothing to save.
        "terminationGracePeriodSeconds": 5,
        "containers": [_container(spec)],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": NAME, "namespace": spec.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def node_agent_network_policy(namespace: str) -> dict[str, Any]:
    """The agent's egress: the instance metadata service and HTTPS (the API server), nothing
    else. The API server is named by port, not address: AKS's is outside the cluster at an
    address the program cannot know, and Cilium may give it its own identity, which an ipBlock
    does not match (cilium/cilium #20550); a rule with ports and no peers admits any peer (where
    an ipBlock of 0.0.0.0/0 did not, cilium/cilium #35212)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{NAME}-egress", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": dict(NODE_AGENT_LABELS)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [
                {
                    "to": [{"ipBlock": {"cidr": IMDS_CIDR}}],
                    "ports": [{"protocol": "TCP", "port": IMDS_PORT}],
                },
                {"ports": [{"protocol": "TCP", "port": HTTPS_PORT}]},
            ],
        },
    }


def node_agent_rbac(namespace: str) -> list[dict[str, Any]]:
    """ServiceAccount, what it may do, and the bindings: the workers' pods in the namespace (list,
    delete), the nodes (get and list their VMs, patch to cordon)."""
    account = {"kind": "ServiceAccount", "name": NAME, "namespace": namespace}
    cluster_name = f"{namespace}-{NAME}"
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": NAME, "namespace": namespace},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": NAME, "namespace": namespace},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": NAME, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
            "subjects": [account],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": cluster_name},
            "rules": [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": cluster_name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": cluster_name,
            },
            "subjects": [account],
        },
    ]
