"""The AKS cluster: a fixed bootstrap pool inline, and the CPU and GPU Spot pools as AgentPools.

AKS accepts a cluster's first (System) pool only inline, and then refuses both a new pool in
that list ("A new agent pool was introduced", pulumi-azure-native #579, #2719) and a change of
its VM size ("You can't change the VM size of a node pool after you create it", AKS *Manage
node pools*). So the inline pool is a small bootstrap pool that never changes: one
``Standard_D2s_v5``, tainted ``CriticalAddonsOnly`` so that only AKS's own system pods run on
it. etcd, the operator and the data staging run on the CPU pool (``systemVmSize``,
``systemNodeCount``), and the training on the GPU Spot pool; both are separate ``AgentPool``
resources whose names derive from their create-only settings, so a change of size is a new
pool, created before the old one is deleted, never a refused update and never a new cluster.
Editing inline pools would also put every pool into "Scaling" (pulumi-azure-native #4264).
Spec builders are pure and return the SDK's keyword arguments.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_azure_native as azure_native

from infra.kubeconfig import azure_cli_kubeconfig
from infra.roles import AKS_RBAC_CLUSTER_ADMIN, assign_role
from stack_config import ClusterConfig, GpuPoolConfig

# Our node label (AKS reserves the kubernetes.azure.com/ and kubernetes.io/ prefixes).
POOL_LABEL = "spot-lab/pool"
SYSTEM_POOL = "system"
GPU_SPOT_POOL = "gpu-spot"
# AKS puts this taint on every Spot node itself; declaring it keeps `refresh` free of drift.
SPOT_TAINT = "kubernetes.azure.com/scalesetpriority=spot:NoSchedule"
# Only pods that ask for a GPU (and tolerate this) land on the expensive nodes.
GPU_TAINT = "nvidia.com/gpu=present:NoSchedule"
BOOTSTRAP_POOL = "bootstrap"
BOOTSTRAP_POOL_NAME = "bootstrap"
# AKS's smallest recommended system node size (2 vCPUs, 8 GiB); it runs only AKS's addons.
BOOTSTRAP_VM_SIZE = "Standard_D2s_v5"
# AKS's documented taint for a dedicated system pool: only critical addons tolerate it.
CRITICAL_ADDONS_TAINT = "CriticalAddonsOnly=true:NoSchedule"
SYSTEM_POOL_NAME_PREFIX = "sys"
GPU_POOL_NAME_PREFIX = "gpu"
# Linux agent pool names: lowercase letters and digits, at most 12 characters.
POOL_NAME_HASH = 8

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
SYSTEM_POOL_CREATE_ONLY = ("vm_size", "scale_set_priority", "os_type", "type")


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
        "node_labels": {POOL_LABEL: BOOTSTRAP_POOL},
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
        "node_labels": {POOL_LABEL: SYSTEM_POOL},
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
        "count": pool.min_nodes,
        "node_taints": [SPOT_TAINT, GPU_TAINT],
        "node_labels": {POOL_LABEL: GPU_SPOT_POOL},
        # AKS installs the NVIDIA driver only (the device plugin is ours); creation-time only.
        "gpu_profile": {"driver": "Install"},
    }
    if kubernetes_version:
        spec["orchestrator_version"] = kubernetes_version
    # The name carries the create-only settings: changing one names a new pool, which Pulumi
    # creates before it deletes the old one (the pool is never missing, and the new one starts
    # at gpuMinNodes, so the Spot quota is not held twice while the job moves over). Min/max
    # counts and labels stay in-place updates.
    spec["agent_pool_name"] = gpu_pool_name(spec)
    return spec


def pool_name(prefix: str, spec: dict[str, Any], create_only: tuple[str, ...]) -> str:
    """``prefix`` + a hash of the pool's create-only settings: a new name for a new pool."""
    settings = {key: spec[key] for key in create_only}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return prefix + digest[:POOL_NAME_HASH]


def gpu_pool_name(spec: dict[str, Any]) -> str:
    """The GPU Spot pool's name."""
    return pool_name(GPU_POOL_NAME_PREFIX, spec, GPU_POOL_CREATE_ONLY)


def autoscaler_profile() -> dict[str, str]:
    """Cluster autoscaler tuning for a pool that scales from zero and costs money per minute."""
    return {
        # Give back idle GPU nodes after 5 min instead of the default 10.
        "scale_down_unneeded_time": "5m",
        "scale_down_delay_after_add": "5m",
        # Workers keep /dev/shm and scratch in emptyDir; that must not pin a node.
        "skip_nodes_with_local_storage": "false",
        "expander": "least-waste",
    }


def network_profile() -> dict[str, str]:
    """Azure CNI overlay with the Cilium dataplane, which also enforces NetworkPolicy.

    AKS accepts ``network_policy="cilium"`` only with ``network_dataplane="cilium"``; Cilium
    enforces policy in eBPF, so no separate policy engine runs on the (few, busy) nodes.
    Overlay gives pods addresses outside the VNet, so no subnet sizing for the pods.
    """
    return {
        "network_plugin": "azure",
        "network_plugin_mode": "overlay",
        "network_dataplane": "cilium",
        "network_policy": "cilium",
        "load_balancer_sku": "standard",
    }


def managed_cluster_spec(
    cluster_name: str, location: str, cluster: ClusterConfig, tags: dict[str, str]
) -> dict[str, Any]:
    """The ``ManagedCluster`` arguments (without the resource group)."""
    spec: dict[str, Any] = {
        "resource_name_": cluster_name,
        "location": location,
        "dns_prefix": cluster_name,
        "identity": {"type": "SystemAssigned"},
        "sku": {"name": "Base", "tier": "Free"},
        "enable_rbac": True,
        "agent_pool_profiles": [bootstrap_pool_profile(cluster.kubernetes_version)],
        "network_profile": network_profile(),
        "auto_scaler_profile": autoscaler_profile(),
        # No Blob CSI volumes: the workers reach Blob Storage with their own identity.
        "storage_profile": {"blob_csi_driver": {"enabled": False}},
        # Entra ID sign-in with Azure RBAC, and no local accounts: no long-lived admin
        # certificate exists to leak (ManagedClusterAADProfile, disableLocalAccounts in the
        # AKS API; AKS docs "Manage local accounts with AKS-managed Microsoft Entra
        # integration": disabling them needs managed Entra ID).
        "aad_profile": {"managed": True, "enable_azure_rbac": True},
        "disable_local_accounts": True,
        # OIDC issuer + workload identity: training pods get Azure tokens without secrets.
        "oidc_issuer_profile": {"enabled": True},
        "security_profile": {"workload_identity": {"enabled": True}},
        "tags": tags,
    }
    if cluster.kubernetes_version:
        spec["kubernetes_version"] = cluster.kubernetes_version
    if cluster.authorized_ip_ranges:
        spec["api_server_access_profile"] = {"authorized_ip_ranges": cluster.authorized_ip_ranges}
    return spec


def _camel(key: str) -> str:
    """The provider's property name for an SDK keyword: ``vm_size`` -> ``vmSize``."""
    head, *rest = key.split("_")
    return head + "".join(part.title() for part in rest)


def decode_kubeconfig(value: str) -> str:
    """The kubeconfig text from ``listManagedClusterUserCredentials``' base64 value."""
    return base64.b64decode(value).decode("utf-8")


@dataclass
class AksClusterArgs:
    """Inputs of ``AksCluster``."""

    resource_group_name: pulumi.Input[str]
    """Resource group the cluster lives in."""
    cluster_name: str
    """Physical name of the managed cluster (also its DNS prefix)."""
    location: str
    """Azure region."""
    cluster: ClusterConfig
    """Kubernetes version and system pool settings."""
    gpu_pool: GpuPoolConfig
    """GPU Spot pool settings."""
    gpu_max_nodes: int
    """The GPU pool's autoscaler ceiling: gpuMaxNodes, or workerMaxReplicas when unset."""
    admin_object_id: pulumi.Input[str]
    """Whoever runs ``pulumi up``: granted cluster admin through Azure RBAC."""
    admin_principal_type: str
    """``User`` or ``ServicePrincipal``: what ``admin_object_id`` is."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags on every Azure resource."""


class AksCluster(pulumi.ComponentResource):
    """AKS with a bootstrap pool, a CPU pool, a GPU Spot pool, Blob CSI, OIDC and workload
    identity."""

    name: pulumi.Output[str]
    gpu_pool_name: pulumi.Output[str]
    """The GPU Spot pool's name, derived from its create-only settings."""
    node_resource_group: pulumi.Output[str]
    kubelet_client_id: pulumi.Output[str]
    kubelet_object_id: pulumi.Output[str]
    oidc_issuer_url: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    admin_grant: pulumi.Resource
    """The deployer's cluster-admin role: the Kubernetes provider must wait for it."""

    def __init__(
        self, name: str, args: AksClusterArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:cluster:AksCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cluster = azure_native.containerservice.ManagedCluster(
            f"{name}-aks",
            resource_group_name=args.resource_group_name,
            **managed_cluster_spec(args.cluster_name, args.location, args.cluster, args.tags),
            opts=child,
        )
        azure_native.containerservice.AgentPool(
            f"{name}-system",
            resource_group_name=args.resource_group_name,
            resource_name_=cluster.name,
            **system_pool_spec(args.cluster),
            opts=pulumi.ResourceOptions(
                parent=self,
                replace_on_changes=[_camel(key) for key in SYSTEM_POOL_CREATE_ONLY],
            ),
        )
        gpu_pool = azure_native.containerservice.AgentPool(
            f"{name}-gpu-spot",
            resource_group_name=args.resource_group_name,
            resource_name_=cluster.name,
            **gpu_spot_pool_spec(
                args.gpu_pool, args.gpu_max_nodes, args.cluster.kubernetes_version
            ),
            opts=pulumi.ResourceOptions(
                parent=self,
                # The autoscaler owns the node count after creation.
                ignore_changes=["count"],
                # Belt and braces with the derived name: whatever a provider release decides for
                # these properties (pulumi-azure-native #3655 made some replace, #2774 dropped
                # others), a change to one replaces the pool instead of a refused update.
                replace_on_changes=[_camel(key) for key in GPU_POOL_CREATE_ONLY],
            ),
        )
        self.name = cluster.name
        self.gpu_pool_name = gpu_pool.name
        self.node_resource_group = cluster.node_resource_group.apply(lambda v: v or "")
        kubelet = cluster.identity_profile.apply(lambda p: (p or {})["kubeletidentity"])
        self.kubelet_client_id = kubelet.apply(lambda k: k.client_id)
        self.kubelet_object_id = kubelet.apply(lambda k: k.object_id)
        self.oidc_issuer_url = cluster.oidc_issuer_profile.apply(lambda p: p.issuer_url)
        self.admin_grant = assign_role(
            f"{name}-deployer-cluster-admin",
            principal_id=args.admin_object_id,
            role=AKS_RBAC_CLUSTER_ADMIN,
            scope=cluster.id,
            parent=self,
            principal_type=args.admin_principal_type,
        )
        # Exec format: the kubelogin plugin, no credential (infra/kubeconfig.py).
        credentials = azure_native.containerservice.list_managed_cluster_user_credentials_output(
            resource_group_name=args.resource_group_name,
            resource_name=cluster.name,
            format="exec",
            opts=pulumi.InvokeOutputOptions(parent=self),
        )
        # Secret although it holds no credential: it names the API server of the lab.
        self.kubeconfig = pulumi.Output.secret(
            credentials.kubeconfigs.apply(
                lambda kcs: azure_cli_kubeconfig(decode_kubeconfig(kcs[0].value))
            )
        )
        self.register_outputs(
            {
                "name": self.name,
                "gpu_pool_name": self.gpu_pool_name,
                "node_resource_group": self.node_resource_group,
                "kubelet_client_id": self.kubelet_client_id,
                "kubelet_object_id": self.kubelet_object_id,
                "oidc_issuer_url": self.oidc_issuer_url,
                "kubeconfig": self.kubeconfig,
            }
        )
