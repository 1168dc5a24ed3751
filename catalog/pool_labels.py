"""Node-pool labels: what the AKS pools put on their nodes and the workloads select on.

One home for both sides (``infra/cluster.py`` sets them, ``workloads/manifests/scheduling.py``
selects them), so a pod always lands on the pool it was meant for. Our labels avoid the
``kubernetes.azure.com/`` and ``kubernetes.io/`` prefixes, which AKS reserves. Pure: imports
nothing of ours.
"""

from __future__ import annotations

POOL_LABEL = "spot-lab/pool"
"""Which kind of pool a node belongs to."""
BOOTSTRAP = "bootstrap"
"""AKS's own add-ons only (the fixed inline System pool)."""
SYSTEM = "system"
"""The on-demand CPU pool: etcd, the operator, data staging."""
GPU_SPOT = "gpu-spot"
"""The GPU Spot pool the training workers run on (every generation of it)."""
GPU_ON_DEMAND = "gpu-on-demand"
"""The optional on-demand pool of the same GPU size the workers fall back to."""
GPU_KINDS = (GPU_SPOT, GPU_ON_DEMAND)

GENERATION_LABEL = "spot-lab/pool-generation"
"""Which generation of a pool a node belongs to: the AgentPool's own name. A change of a
create-only setting (VM size, Spot price) makes a new pool beside the old one; the job selects
the new generation, so no worker lands on a pool that is about to be deleted. The on-demand
fallback pool's nodes carry the generation of the Spot pool they stand in for."""


def pool_labels(kind: str, pool_name: str | None = None) -> dict[str, str]:
    """The labels a pool of ``kind`` puts on its nodes (with its generation when named)."""
    labels = {POOL_LABEL: kind}
    if pool_name:
        labels[GENERATION_LABEL] = pool_name
    return labels


def gpu_pool_selector(pool_name: str) -> dict[str, str]:
    """The node selector of a pod that must run on exactly this GPU Spot pool generation."""
    if not pool_name:
        raise ValueError("the GPU pool's name must not be empty: it selects its generation")
    return pool_labels(GPU_SPOT, pool_name)


def gpu_generation_selector(pool_name: str) -> dict[str, str]:
    """The node selector of a pod that may run on either GPU pool of this generation: the
    Spot pool named ``pool_name`` or the on-demand fallback pool beside it."""
    if not pool_name:
        raise ValueError("the GPU pool's name must not be empty: it selects its generation")
    return {GENERATION_LABEL: pool_name}
