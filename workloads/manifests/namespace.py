"""The lab's namespace and the training pods' ServiceAccount (workload identity)."""

from __future__ import annotations

from typing import Any

from workloads.manifests.pod_security import namespace_labels
from workloads.manifests.scheduling import ROLE_LABEL

WORKLOAD_IDENTITY_CLIENT_ID = "azure.workload.identity/client-id"
# Pods opt in with this label; the webhook then injects AZURE_CLIENT_ID and a token file.
WORKLOAD_IDENTITY_USE = {"azure.workload.identity/use": "true"}


def namespace_manifest(name: str, allow_ipc_lock: bool = False) -> dict[str, Any]:
    """The namespace for etcd, the volumes' claims and the training job.

    Pod Security "baseline" is enforced: nothing in the lab needs host access, so a pod that
    asks for it is a mistake worth rejecting. With InfiniBand the workers need ``IPC_LOCK``,
    which baseline refuses: then a policy of our own enforces baseline with that one capability
    added (``workloads/manifests/pod_security.py``).
    """
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/part-of": "spot-lab", **namespace_labels(allow_ipc_lock)},
        },
    }


def training_service_account(name: str, namespace: str, client_id: str) -> dict[str, Any]:
    """The training pods' ServiceAccount, bound to the training identity by its client id.

    The identity's federated credential trusts ``system:serviceaccount:<namespace>:<name>``,
    so pods running as this account get Azure tokens without any secret in the cluster.
    """
    if not client_id:
        raise ValueError("training client_id must not be empty: workload identity needs it")
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": {WORKLOAD_IDENTITY_CLIENT_ID: client_id},
        },
    }


# Azure's instance metadata service: it hands the node's (kubelet's) managed identity to any
# process on the node that asks. A pod with its own identity never needs it.
IMDS_CIDR = "169.254.169.254/32"
DNS_PORT = 53


def identity_egress_policy(namespace: str) -> dict[str, Any]:
    """Pods that hold a workload identity may reach anything but the instance metadata service.

    The pods are the workers and the staging Job (``azure.workload.identity/use``). Allowed:
    the internet and Azure's public endpoints (Blob Storage, the Entra ID token endpoint, the
    dataset's source) through ``ipBlock``; the pods of this namespace (etcd, the other workers'
    collectives); and cluster DNS. Cilium matches an ``ipBlock`` only against addresses outside
    the cluster, never against pods, so the in-cluster peers get rules of their own. The
    ``except`` keeps a compromised training process from taking the node's identity.
    """
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "identity-pods-egress", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": dict(WORKLOAD_IDENTITY_USE)},
            "policyTypes": ["Egress"],
            "egress": [
                {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": [IMDS_CIDR]}}]},
                {"to": [{"podSelector": {}}]},
                {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                            },
                            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        }
                    ],
                    "ports": [
                        {"protocol": "UDP", "port": DNS_PORT},
                        {"protocol": "TCP", "port": DNS_PORT},
                    ],
                },
            ],
        },
    }


NODE_AGENT_ROLE = "node-agent"
"""The ``spot-lab/role`` of the GPU nodes' agent (``workloads/manifests/node_agent.py``): the one
pod of the namespace that may reach the instance metadata service."""


def metadata_egress_policy(namespace: str) -> dict[str, Any]:
    """Every pod of the namespace but the node agent may reach anything but the instance
    metadata service: etcd and any pod without an identity too, not only the identity pods
    (``identity_egress_policy``), so that only the agent, which reads the node's Scheduled
    Events there, can ask it for the node's identity. Policies add up: a pod both select still
    reaches no metadata address, since neither admits it."""
    selector = {"key": ROLE_LABEL, "operator": "NotIn", "values": [NODE_AGENT_ROLE]}
    allowed = identity_egress_policy(namespace)["spec"]["egress"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "no-metadata-egress", "namespace": namespace},
        "spec": {
            "podSelector": {"matchExpressions": [selector]},
            "policyTypes": ["Egress"],
            "egress": allowed,
        },
    }
