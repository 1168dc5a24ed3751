"""The lab's namespace and the training pods' ServiceAccount (workload identity)."""

from __future__ import annotations

from typing import Any

WORKLOAD_IDENTITY_CLIENT_ID = "azure.workload.identity/client-id"
# Pods opt in with this label; the webhook then injects AZURE_CLIENT_ID and a token file.
WORKLOAD_IDENTITY_USE = {"azure.workload.identity/use": "true"}


def namespace_manifest(name: str) -> dict[str, Any]:
    """The namespace for etcd, the volumes' claims and the training job.

    Pod Security "baseline" is enforced: nothing in the lab needs host access, so a pod that
    asks for it is a mistake worth rejecting.
    """
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/part-of": "spot-lab",
                "pod-security.kubernetes.io/enforce": "baseline",
            },
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
