"""Where pods may run: the node-pool labels and taints the cluster and the workloads share.

The AKS node pools carry these labels (``catalog/pool_labels.py``, set by
``infra/node_pools.py``) and taints; every workload here selects and tolerates them, so a pod lands
on the pool it was meant for.
"""

from __future__ import annotations

from typing import Any

from catalog.pool_labels import GPU_KINDS, GPU_SPOT, POOL_LABEL, SYSTEM

SYSTEM_POOL = {POOL_LABEL: SYSTEM}
"""Selects the on-demand CPU pool: etcd and the operator must outlive any spot eviction."""
GPU_SPOT_POOL = {POOL_LABEL: GPU_SPOT}
"""Selects every generation of the GPU Spot pool (the device plugin); the job selects one
(``catalog.pool_labels.gpu_pool_selector``)."""
SPOT_PREFERENCE_WEIGHT = 100
"""The scheduler adds a preferred term's weight (1-100) to a node's score: the largest, so a
Ready Spot node with room always wins over an on-demand one."""

ROLE_LABEL = "spot-lab/role"
TRAINER_LABELS = {ROLE_LABEL: "trainer"}
"""On every training pod; the rendezvous NetworkPolicy admits pods with these labels."""
RENDEZVOUS_LABELS = {ROLE_LABEL: "rendezvous"}
"""On every etcd pod."""

# AKS puts this taint on every Spot node; only pods that accept eviction tolerate it.
SPOT_TOLERATION: dict[str, Any] = {
    "key": "kubernetes.azure.com/scalesetpriority",
    "operator": "Equal",
    "value": "spot",
    "effect": "NoSchedule",
}
# The GPU pool's own taint keeps CPU-only pods off expensive nodes.
GPU_TOLERATION: dict[str, Any] = {
    "key": "nvidia.com/gpu",
    "operator": "Exists",
    "effect": "NoSchedule",
}
# A system pool created with only-critical-addons carries this taint; the rendezvous is
# the training job's control plane, so it may run there.
CRITICAL_ADDONS_TOLERATION: dict[str, Any] = {
    "key": "CriticalAddonsOnly",
    "operator": "Exists",
}


# How long a worker stays bound to a node that stopped reporting (not-ready) or cannot be
# reached before the taint manager deletes it. Without a toleration of its own, the
# DefaultTolerationSeconds admission plugin gives every pod 300 s (Kubernetes docs, Taints and
# Tolerations, "Taint based Evictions"). That delete is graceful, so on a node whose kubelet is
# gone the pod object stays (Terminating) until the kubelet confirms, the Node object is deleted
# or the pod is force-deleted; its replacement, which has the same name, waits for it. So what
# shortens a vanished VM's replacement is the node agent's force delete (training/node_agent/),
# not this. What 30 s buys: a node that comes back (a kubelet restart, a network blip longer
# than 30 s) has its worker stopped and recreated at once, instead of up to 300 s later while
# the survivors train without it.
NODE_LOSS_TOLERATION_S = 30
NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_loss_tolerations() -> list[dict[str, Any]]:
    """A worker's tolerations of a lost node: evicted after ``NODE_LOSS_TOLERATION_S``."""
    return [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": NODE_LOSS_TOLERATION_S,
        }
        for key in NODE_LOSS_TAINTS
    ]


def gpu_spot_tolerations() -> list[dict[str, Any]]:
    """Tolerations every pod bound for the GPU Spot pool needs (fresh copies)."""
    return [dict(SPOT_TOLERATION), dict(GPU_TOLERATION)]


def spot_preference() -> dict[str, Any]:
    """A pod's affinity that prefers the GPU Spot pool and leaves the on-demand fallback pool
    (of the same generation, which the node selector picks) as the place it may also run."""
    term = {"matchExpressions": [{"key": POOL_LABEL, "operator": "In", "values": [GPU_SPOT]}]}
    preferred = [{"weight": SPOT_PREFERENCE_WEIGHT, "preference": term}]
    return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}


def any_gpu_pool() -> dict[str, Any]:
    """A pod's affinity that requires a node of either GPU pool, Spot or on-demand (the device
    plugin, which every GPU node needs)."""
    term = {"matchExpressions": [{"key": POOL_LABEL, "operator": "In", "values": list(GPU_KINDS)}]}
    required = {"nodeSelectorTerms": [term]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}


def gpu_nodes_selector(fallback: bool) -> str:
    """``kubectl get nodes -l`` for the job's GPU nodes: the Spot pool's, and the on-demand
    fallback pool's when it is on."""
    if fallback:
        return f"'{POOL_LABEL} in ({','.join(GPU_KINDS)})'"
    return f"{POOL_LABEL}={GPU_SPOT}"
