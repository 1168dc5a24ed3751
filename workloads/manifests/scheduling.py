"""Where pods may run: the node-pool labels and taints the cluster and the workloads share.

The AKS node pools carry these labels and taints (``infra/cluster.py``); every workload here
selects and tolerates them, so a pod lands on the pool it was meant for.
"""

from __future__ import annotations

from typing import Any

POOL_LABEL = "spot-lab/pool"
SYSTEM_POOL = {POOL_LABEL: "system"}
"""Selects the on-demand CPU pool: etcd and the operator must outlive any spot eviction."""
GPU_SPOT_POOL = {POOL_LABEL: "gpu-spot"}
"""Selects the GPU Spot pool the training workers run on."""

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


def gpu_spot_tolerations() -> list[dict[str, Any]]:
    """Tolerations every pod bound for the GPU Spot pool needs (fresh copies)."""
    return [dict(SPOT_TOLERATION), dict(GPU_TOLERATION)]
