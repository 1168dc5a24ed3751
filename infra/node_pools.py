"""The AKS node pools: a fixed bootstrap pool inline, and the CPU and GPU Spot pools as AgentPools.

AKS accepts a cluster's first (System) pool only inline, and then refuses both a new pool in
that list ("A new agent pool was introduced", pulumi-azure-native #579, #2719) and a change of
its VM size ("You can't change the VM size of a node pool after you create it", AKS *Manage
node pools*). So the inline pool is a small bootstrap pool that never changes: one
``Standard_D2s_v5``, tainted ``CriticalAddonsOnly`` so that only AKS's own system pods run on
it. etcd, the operator and the data staging run on the CPU pool (``systemVmSize``,
``systemNodeCount``), and the training on the GPU Spot pool; both are separate ``AgentPool``
resources whose names derive from their create-only settings, so a change of size is a new
pool, created before the old one is deleted, never a refused update and never a new cluster.
Each GPU pool generation labels its nodes with its own name, and the job selects it
(``catalog/pool_labels.py``). The optional on-demand fallback pool of the same size
(``onDemandMaxNodes``) carries the Spot pool's generation and its name hashes it, so a new
Spot pool always brings a new fallback pool beside it. Pure: the builders return the SDK's
keyword arguments.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass
from typing import Any

from catalog.gpu_pools import NAME_HASH, ON_DEMAND_PREFIX, SPOT_PREFIX
from catalog.pool_labels import BOOTSTRAP, GPU_ON_DEMAND, GPU_SPOT, SYSTEM, pool_labels
from stack_config import ClusterConfig, FallbackConfig, GpuPoolConfig

# AKS puts this taint on every Spot node itself; declaring it keeps `refresh` free of drift.
SPOT_TAINT = "kubernetes.azure.com/scalesetpriority=spot:NoSchedule"
# And this label, in the pool's own nodeLabels (AKS, "Add a Spot node pool": a Spot pool's
# nodes get the label and the taint). Declared for the same reason, and because a pool update
# replaces the whole label set: labels sent without it delete it from the pool's nodes
# (Azure/AKS #3152), and with it every Spot-targeted affinity.
SPOT_LABEL = {"kubernetes.azure.com/scalesetpriority": "spot"}
# Only pods that ask for a GPU (and tolerate this) land on the expensive nodes.
GPU_TAINT = "nvidia.com/gpu=present:NoSchedule"
BOOTSTRAP_POOL_NAME = "bootstrap"
# AKS's smallest recommended system node size (2 vCPUs, 8 GiB); it runs only AKS's addons.
BOOTSTRAP_VM_SIZE = "Standard_D2s_v5"
# AKS's documented taint for a dedicated system pool: only critical addons tolerate it.
CRITICAL_ADDONS_TAINT = "CriticalAddonsOnly=true:NoSchedule"
SYSTEM_POOL_NAME_PREFIX = "sys"
GPU_POOL_NAME_PREFIX = SPOT_PREFIX
# Linux agent pool names: lowercase letters and digits, at most 12 characters.
POOL_NAME_HASH = NAME_HASH

# Properties of an agent pool that AKS refuses to change after creation, of those this pool
# sets: "You can't change the VM size of a node pool after you create it" (AKS, Manage node
# pools, Limitations); "ScaleSetPriority or SpotMaxPrice can't be changed after creation"
# (AKS, Spot node pools, Limitations), and so the eviction policy with them; gpuProfile.driver
# is set only at creation (NOTES, AKS GPU docs); OS type and pool type define the scale set.
GPU_POOL_CREATE_ONLY = (
    "vm_size",
    "scale_set_priority",
    "scale_set_eviction_policy",
    "spot_max_price",
    "gpu_profile",
    "os_type",
    "type",
)
# An autoscaled pool's count is the autoscaler's: AKS, "Use the cluster autoscaler": "Let the
# Kubernetes cluster autoscaler manage the required scale settings". A create carries the
# program's count (AKS requires one, pulumi-azure-native #2943: "Required parameter
# properties.count is missing"). After that Pulumi keeps the count its state holds ("Pulumi
# ignores a property by using the old value from the state instead of the value provided by
# the program", Pulumi docs, resource option ignoreChanges), so an `up` never plans a count of
# its own: a PUT while the pool is Scaling is refused (OperationNotAllowed, Azure/AKS #1561),
# and one that succeeds leaves the pool Updating for minutes, adding no Spot node meanwhile.
# Terraform gives the same advice for node_count.
AUTOSCALED_COUNT = ("count",)
# And since no `up` refreshes (a refresh rewrites the cluster, infra/cluster.py), the state's
# count is the one the pool was created with: a pool PUT that carried it would scale the pool
# back to it ("the azurerm provider attempts to reset the node count to the initial value",
# FairwindsOps/azure-terraform-modules PR 3) or be refused as a manual scale. So an autoscaled
# pool is never PUT by Pulumi after its create: its bounds and its Kubernetes version, the
# settings that change in place, are left to `az aks nodepool update --update-cluster-autoscaler`
# and `az aks nodepool upgrade`, which read the live pool and PUT it back with only that setting
# changed, its live count kept (azure-cli, command_modules/acs/custom.py, aks_agentpool_upgrade:
# `instance = client.get(...)`; `instance.orchestrator_version = kubernetes_version`;
# `begin_create_or_update(..., instance)`; the update decorator reads the pool the same way).
AUTOSCALED_IN_PLACE = ("min_count", "max_count", "orchestrator_version")
AUTOSCALED_IGNORED = (*AUTOSCALED_COUNT, *AUTOSCALED_IN_PLACE)
SYSTEM_POOL_CREATE_ONLY = ("vm_size", "scale_set_priority", "os_type", "type")
# The fallback pool's, plus the generation it belongs to (the Spot pool's name).
ON_DEMAND_POOL_CREATE_ONLY = ("vm_size", "scale_set_priority", "gpu_profile", "os_type", "type")


def bootstrap_pool_profile(kubernetes_version: str | None) -> dict[str, Any]:
    """The inline System pool: fixed, one small node, only AKS's critical addons on it."""
    profile: dict[str, Any] = {
        "name": BOOTSTRAP_POOL_NAME,
        "mode": "System",
        "type": "VirtualMachineScaleSets",
        "os_type": "Linux",
        "vm_size": BOOTSTRAP_VM_SIZE,
        "count": 1,
        "scale_set_priority": "Regular",
        "node_taints": [CRITICAL_ADDONS_TAINT],
        "node_labels": pool_labels(BOOTSTRAP),
    }
    if kubernetes_version:
        profile["orchestrator_version"] = kubernetes_version
    return profile


def system_pool_spec(cluster: ClusterConfig) -> dict[str, Any]:
    """The CPU pool's ``AgentPool`` arguments: regular nodes for etcd, the operator, staging."""
    spec: dict[str, Any] = {
        "mode": "User",
        "type": "VirtualMachineScaleSets",
        "os_type": "Linux",
        "vm_size": cluster.system_vm_size,
        "count": cluster.system_node_count,
        "scale_set_priority": "Regular",
        "node_labels": pool_labels(SYSTEM),
    }
    if cluster.kubernetes_version:
        spec["orchestrator_version"] = cluster.kubernetes_version
    spec["agent_pool_name"] = pool_name(SYSTEM_POOL_NAME_PREFIX, spec, SYSTEM_POOL_CREATE_ONLY)
    return spec


def gpu_spot_pool_spec(
    pool: GpuPoolConfig, max_nodes: int, kubernetes_version: str | None
) -> dict[str, Any]:
    """The GPU Spot pool's ``AgentPool`` arguments (without resource group and cluster).

    ``max_nodes`` is the resolved ceiling (``LabConfig.gpu_max_nodes``), not ``pool.max_nodes``,
    which may be unset.
    """
    spec: dict[str, Any] = {
        "mode": "User",
        "type": "VirtualMachineScaleSets",
        "os_type": "Linux",
        "vm_size": pool.vm_size,
        # Priority and eviction policy can be set only when the pool is created.
        "scale_set_priority": "Spot",
        # Delete (not Deallocate): an evicted node frees its quota and the autoscaler
        # brings up a fresh one when capacity returns.
        "scale_set_eviction_policy": "Delete",
        "spot_max_price": pool.spot_max_price,
        "enable_auto_scaling": True,
        "min_count": pool.min_nodes,
        "max_count": max_nodes,
        # The count a create carries; the autoscaler owns it after that (AUTOSCALED_COUNT).
        "count": pool.min_nodes,
        "node_taints": [SPOT_TAINT, GPU_TAINT],
        # AKS installs the NVIDIA driver only (the device plugin is ours); creation-time only.
        "gpu_profile": {"driver": "Install"},
    }
    if kubernetes_version:
        spec["orchestrator_version"] = kubernetes_version
    # The name carries the create-only settings: changing one names a new pool, which Pulumi
    # creates before it deletes the old one (the pool is never missing, and the new one starts
    # at gpuMinNodes, so the Spot quota is not held twice while the job moves over). Min/max
    # counts stay in-place updates. The name is also the generation label the job selects.
    spec["agent_pool_name"] = gpu_pool_name(spec)
    spec["node_labels"] = {**pool_labels(GPU_SPOT, spec["agent_pool_name"]), **SPOT_LABEL}
    return spec


def gpu_on_demand_pool_spec(
    pool: GpuPoolConfig, fallback: FallbackConfig, generation: str, kubernetes_version: str | None
) -> dict[str, Any]:
    """The on-demand fallback pool's ``AgentPool`` arguments: the GPU Spot pool's size at
    regular priority, from 0 to ``onDemandMaxNodes`` nodes, in the Spot pool's generation.

    Only the GPU taint: AKS taints Spot nodes only. The cluster autoscaler scales this pool
    when the Spot pool cannot grow (the priority expander, ``workloads/manifests/
    autoscaler.py``); the workers prefer Spot nodes and admit both (``workloads/manifests/
    scheduling.py``). Its name hashes its own create-only settings and ``generation``: a new
    Spot pool (a new size or Spot price) brings a new fallback pool with it.
    """
    if not generation:
        raise ValueError("the fallback pool needs the Spot pool's name: it is its generation")
    spec: dict[str, Any] = {
        "mode": "User",
        "type": "VirtualMachineScaleSets",
        "os_type": "Linux",
        "vm_size": pool.vm_size,
        "scale_set_priority": "Regular",
        "enable_auto_scaling": True,
        "min_count": 0,
        "max_count": fallback.max_nodes,
        # A create carries 0: nothing runs on demand until the Spot pool cannot grow.
        "count": 0,
        "node_taints": [GPU_TAINT],
        "gpu_profile": {"driver": "Install"},
    }
    if kubernetes_version:
        spec["orchestrator_version"] = kubernetes_version
    settings = {**spec, "generation": generation}
    spec["agent_pool_name"] = pool_name(
        ON_DEMAND_PREFIX, settings, (*ON_DEMAND_POOL_CREATE_ONLY, "generation")
    )
    spec["node_labels"] = pool_labels(GPU_ON_DEMAND, generation)
    return spec


def pool_name(prefix: str, spec: dict[str, Any], create_only: tuple[str, ...]) -> str:
    """``prefix`` + a hash of the pool's create-only settings: a new name for a new pool."""
    settings = {key: spec[key] for key in create_only}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return prefix + digest[:POOL_NAME_HASH]


def gpu_pool_name(spec: dict[str, Any]) -> str:
    """The GPU Spot pool's name."""
    return pool_name(GPU_POOL_NAME_PREFIX, spec, GPU_POOL_CREATE_ONLY)


# ---- the settings of a pool that `az` changes in place (AUTOSCALED_IN_PLACE) ------------------
# `create` is a no-op: a new pool is created with these settings already, and a PUT right after
# its create would be refused while the autoscaler scales it for the job's first pods.
NO_OP = "true"


@dataclass(frozen=True)
class PoolAddress:
    """Where an agent pool is, as `az aks nodepool` names it."""

    resource_group: str
    cluster: str
    pool: str
    subscription: str

    def flags(self) -> str:
        """The pool's flags; the subscription is the stack's, never az's default."""
        return " ".join(
            f"--{flag} {shlex.quote(value)}"
            for flag, value in (
                ("resource-group", self.resource_group),
                ("cluster-name", self.cluster),
                ("name", self.pool),
                ("subscription", self.subscription),
            )
        )


def bounds_command(address: PoolAddress, min_count: int, max_count: int) -> str:
    """The autoscaler's new bounds for a pool, its live node count kept (az reads the pool)."""
    if not 0 <= min_count <= max_count:
        raise ValueError(f"bounds must be 0 <= min <= max, got {min_count}..{max_count}")
    return (
        f"az aks nodepool update {address.flags()} --update-cluster-autoscaler "
        f"--min-count {min_count} --max-count {max_count} --output none"
    )


def upgrade_command(address: PoolAddress, kubernetes_version: str) -> str:
    """A pool's Kubernetes upgrade, its live node count kept. ``--yes``: az asks before an
    upgrade to the version the pool already runs (which is then a no-op), and `up` has no
    terminal to answer it."""
    if not kubernetes_version:
        raise ValueError("an upgrade needs a Kubernetes version")
    return (
        f"az aks nodepool upgrade {address.flags()} "
        f"--kubernetes-version {shlex.quote(kubernetes_version)} --yes --output none"
    )
