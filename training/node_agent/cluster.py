"""What the node agent does in Kubernetes, through the official client: find the worker pods,
delete them gracefully or by force, cordon a node, map VMs to their Nodes.

A graceful delete (no ``gracePeriodSeconds``) gives a pod its own ``terminationGracePeriodSeconds``:
the kubelet sends SIGTERM and the worker saves within its stop deadline (Kubernetes, "Pod
Lifecycle", Termination of Pods). It is a delete, not an Eviction: the VM goes at ``NotBefore``
whatever a disruption budget says, so none may hold the notice back. A force delete
(``gracePeriodSeconds: 0``) removes the object at once, so the training operator creates the
worker's replacement (the same name) without waiting for a kubelet that is gone; only pods whose
VM is gone are deleted so. Every delete carries the pod's uid as a precondition, so a
replacement that took the name is never hit. Cordoning is ``spec.unschedulable: true``, as
``kubectl cordon`` patches it.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client import CoreV1Api, V1DeleteOptions, V1Preconditions
from kubernetes.client.exceptions import ApiException

from training.node_agent.scheduled_events import vm_name

GONE = (404, 409)
"""A pod already deleted (404), or its name already a replacement's (409: the uid differs)."""


class Cluster:
    """The worker pods of one namespace, and the nodes they run on."""

    def __init__(self, api: CoreV1Api, namespace: str, worker_selector: str) -> None:
        self.api, self.namespace, self.worker_selector = api, namespace, worker_selector

    def vm_of(self, node: str) -> str | None:
        """The Scheduled Events name of the VM behind ``node``."""
        return vm_name(self.api.read_node(node).spec.provider_id or "")

    def nodes_by_vm(self) -> dict[str, str]:
        """Every Node with an Azure VM, keyed by its VM's Scheduled Events name (lowercase)."""
        found = {}
        for node in self.api.list_node().items:
            if vm := vm_name(node.spec.provider_id or ""):
                found[vm.lower()] = node.metadata.name
        return found

    def node_names(self) -> set[str]:
        return {node.metadata.name for node in self.api.list_node().items}

    def workers(self, node: str | None = None) -> list[Any]:
        """The worker pods (on ``node``, or anywhere)."""
        selector = {"field_selector": f"spec.nodeName={node}"} if node else {}
        pods = self.api.list_namespaced_pod(
            self.namespace, label_selector=self.worker_selector, **selector
        ).items
        return [p for p in pods if node is None or p.spec.node_name == node]

    def evict(self, pod: Any) -> bool:
        """Delete ``pod`` gracefully: SIGTERM now, SIGKILL after its own grace period."""
        return self._delete(pod, None)

    def force_delete(self, pod: Any) -> bool:
        """Remove ``pod``'s object at once: its VM is gone, no kubelet will confirm."""
        return self._delete(pod, 0)

    def cordon(self, node: str) -> None:
        self.api.patch_node(node, {"spec": {"unschedulable": True}})

    def _delete(self, pod: Any, grace_s: int | None) -> bool:
        options = V1DeleteOptions(
            preconditions=V1Preconditions(uid=pod.metadata.uid), grace_period_seconds=grace_s
        )
        try:
            self.api.delete_namespaced_pod(pod.metadata.name, self.namespace, body=options)
        except ApiException as exc:
            if exc.status in GONE:
                return False
            raise
        return True
