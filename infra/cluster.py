"""The AKS cluster: Entra ID with Azure RBAC, workload identity, the managed Blob CSI driver, and
its node pools (``infra/node_pools.py``), with the deployer as its admin.

With the on-demand fallback on, the cluster autoscaler chooses between the GPU pools with the
priority expander: AKS takes ``expander: priority`` in ``autoScalerProfile`` (REST spec,
``ManagedClusterAutoScalerProfile.expander``: "Selects the node group that has the highest
priority assigned by the user", configured as the autoscaler's priority readme says; AKS
CHANGELOG, release 2021-01-04: the profile "now exposes the max-node-provision-time and
priority properties"; release 2021-06-03 fixed AKS's priority expander "falling back to a random
choice when a higher priority exists", Azure/AKS issue 2359), and reads the priorities from the
``cluster-autoscaler-priority-expander`` ConfigMap in ``kube-system``
(``workloads/manifests/autoscaler.py``).

The node pools are separate ``AgentPool`` resources (only the fixed bootstrap pool is inline),
so a change of size is a new pool, never a new cluster. The deployer's cluster-admin role is
waited for until the API server honours it (``infra/cluster_access.py``). Spec builders are
pure and return the SDK's keyword arguments.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_azure_native as azure_native
import pulumi_command as command

from catalog.deployer import DeployerSignIn
from catalog.gpu_pools import MAX_GPU_NODES
from infra.cluster_access import ClusterAccessWait, ClusterAccessWaitArgs
from infra.kubeconfig import deployer_kubeconfig
from infra.node_pools import (
    AUTOSCALED_IGNORED,
    BOOTSTRAP_POOL_NAME,
    GPU_POOL_CREATE_ONLY,
    NO_OP,
    ON_DEMAND_POOL_CREATE_ONLY,
    SYSTEM_POOL_CREATE_ONLY,
    PoolAddress,
    bootstrap_pool_profile,
    bounds_command,
    gpu_on_demand_pool_spec,
    gpu_spot_pool_spec,
    system_pool_spec,
    upgrade_command,
)
from infra.roles import AKS_RBAC_CLUSTER_ADMIN, assign_role
from stack_config import ClusterConfig, FallbackConfig, GpuPoolConfig

# The cluster's inline pool list never takes part in a diff. A refresh copies every pool of the
# cluster, the separate AgentPools included, into it (pulumi-azure-native #1532: after a pool
# changed outside, `pulumi up --refresh` planned the cluster's replacement), and a cluster PUT
# with a changed list reconciles every pool, putting all of them into Scaling
# (pulumi-azure-native #4264, closed "won't fix"). The inline pool is the fixed bootstrap pool,
# which no setting changes except its Kubernetes version, and that goes through
# `_upgrade_bootstrap_pool`. A cluster update for another reason sends the list as the state
# holds it (pulumi-azure-native #2719): as created, since no `up` refreshes.
INLINE_POOLS = ("agentPoolProfiles",)


def autoscaler_profile(fallback: FallbackConfig | None = None) -> dict[str, str]:
    """Cluster autoscaler tuning for a pool that scales from zero and costs money per minute.

    Each value against the upstream default, with its reason, is in docs/azure.md ("The
    autoscaler's settings"); left at AKS's defaults: ``scan-interval`` (10s), the 30 s an
    unschedulable GPU pod waits before it counts (fixed in the autoscaler, kubernetes/autoscaler
    #9126, not in AKS's profile), ``new-pod-scale-up-delay`` (0s).

    With the on-demand fallback, the priority expander prefers the Spot pool, and
    ``max_node_provision_time`` is how long the Spot pool has to register a node before the
    autoscaler stops counting on it and scales another pool for the pods still pending
    (kubernetes/autoscaler FAQ, "How does scale-up work?"; ``clusterstate.go``,
    ``updateScaleRequests``: ``ScaleUpTimedOut``, then the group backs off). AKS takes it only as
    whole minutes ("Values must be an integer followed by an 'm'", REST spec). A Spot allocation
    that fails outright is quicker: AKS's autoscaler deletes nodes that fail to provision at
    once instead of waiting out this time (AKS CHANGELOG, release notes 2025-10-12).
    """
    profile = {
        # Give back idle GPU nodes after 5 min instead of the default 10.
        "scale_down_unneeded_time": "5m",
        "scale_down_delay_after_add": "5m",
        # Workers keep /dev/shm and scratch in emptyDir; that must not pin a node.
        "skip_nodes_with_local_storage": "false",
        # Past this many unready nodes (and 45 % of all), the autoscaler "stops all operations
        # until the situation improves" (its FAQ, "How does CA deal with unready nodes?"): an
        # eviction wave that takes every GPU node at once must not stop their replacement. The
        # most GPU nodes the config allows, not this stack's ceilings: a new ceiling is then no
        # cluster PUT, only the pool's (AKS's default, 3, would halt on a wave of 4).
        "ok_total_unready_count": str(MAX_GPU_NODES),
        "expander": "least-waste",
    }
    if fallback is not None and fallback.enabled:
        profile["expander"] = "priority"
        profile["max_node_provision_time"] = f"{fallback.after_minutes}m"
    return profile


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
    cluster_name: str,
    location: str,
    cluster: ClusterConfig,
    tags: dict[str, str],
    fallback: FallbackConfig | None = None,
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
        "auto_scaler_profile": autoscaler_profile(fallback),
        # AKS's managed Blob CSI driver: the dataset's read-only volume mounts through it with
        # the pod's own workload identity (workloads/manifests/volume.py).
        "storage_profile": {"blob_csi_driver": {"enabled": True}},
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
    admin_principal_type: pulumi.Input[str]
    """``User`` or ``ServicePrincipal``: what ``admin_object_id`` is."""
    deployer: DeployerSignIn
    """How the deployer signs in: kubelogin signs in to the cluster the same way."""
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    """The on-demand fallback pool of the GPU size (off by default)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags on every Azure resource."""
    subscription_id: pulumi.Input[str] = ""
    """The stack's subscription: `az aks nodepool` changes the autoscaled pools there."""


class AksCluster(pulumi.ComponentResource):
    """AKS with a bootstrap pool, a CPU pool, a GPU Spot pool (and optionally its on-demand
    fallback), the Blob CSI driver, OIDC and workload identity, and the deployer as its admin."""

    name: pulumi.Output[str]
    gpu_pool_name: pulumi.Output[str]
    """The GPU Spot pool's name, derived from its create-only settings; its generation label."""
    on_demand_pool_name: pulumi.Output[str] | None
    """The on-demand fallback pool's name; None when the fallback is off."""
    node_resource_group: pulumi.Output[str]
    kubelet_client_id: pulumi.Output[str]
    kubelet_object_id: pulumi.Output[str]
    oidc_issuer_url: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    admin_grant: pulumi.Resource
    """The deployer's cluster-admin role assignment."""
    admin_ready: pulumi.Resource
    """Exists once the API server honours that role: every Kubernetes object waits for it."""
    node_pools: list[pulumi.Resource]
    """The CPU and GPU pools the workloads run on: they go after the workloads on destroy."""

    def __init__(
        self, name: str, args: AksClusterArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:cluster:AksCluster", name, None, opts)
        cluster = azure_native.containerservice.ManagedCluster(
            f"{name}-aks",
            resource_group_name=args.resource_group_name,
            **managed_cluster_spec(
                args.cluster_name,
                args.location,
                args.cluster,
                args.tags,
                args.fallback,
            ),
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=list(INLINE_POOLS)),
        )
        self._upgrade_bootstrap_pool(name, args, cluster)
        system_pool = azure_native.containerservice.AgentPool(
            f"{name}-system",
            resource_group_name=args.resource_group_name,
            resource_name_=cluster.name,
            **system_pool_spec(args.cluster),
            opts=pulumi.ResourceOptions(
                parent=self,
                replace_on_changes=[_camel(key) for key in SYSTEM_POOL_CREATE_ONLY],
            ),
        )
        gpu_pools = self._gpu_pools(name, args, cluster)
        self.name = cluster.name
        self.gpu_pool_name = gpu_pools[0].name
        self.on_demand_pool_name = gpu_pools[1].name if len(gpu_pools) > 1 else None
        self.node_pools = [system_pool, *gpu_pools]
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
        self.kubeconfig = self._kubeconfig(args, cluster)
        access = ClusterAccessWait(
            f"{name}-admin-access",
            ClusterAccessWaitArgs(self.kubeconfig, self.admin_grant, args.deployer.describe()),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.admin_ready = access.ready
        outputs = {
            "name": self.name,
            "gpu_pool_name": self.gpu_pool_name,
            "node_resource_group": self.node_resource_group,
            "kubelet_client_id": self.kubelet_client_id,
            "kubelet_object_id": self.kubelet_object_id,
            "oidc_issuer_url": self.oidc_issuer_url,
            "kubeconfig": self.kubeconfig,
        }
        if self.on_demand_pool_name is not None:
            outputs["on_demand_pool_name"] = self.on_demand_pool_name
        self.register_outputs(outputs)

    def _gpu_pools(
        self, name: str, args: AksClusterArgs, cluster: azure_native.containerservice.ManagedCluster
    ) -> list[azure_native.containerservice.AgentPool]:
        """The GPU Spot pool and, with the fallback on, the on-demand pool of its generation."""
        version = args.cluster.kubernetes_version
        spot = gpu_spot_pool_spec(args.gpu_pool, args.gpu_max_nodes, version)
        pools = [self._autoscaled_pool(f"{name}-gpu-spot", args, cluster, spot)]
        if args.fallback.enabled:
            on_demand = gpu_on_demand_pool_spec(
                args.gpu_pool, args.fallback, spot["agent_pool_name"], version
            )
            pools.append(
                self._autoscaled_pool(
                    f"{name}-gpu-on-demand", args, cluster, on_demand, ON_DEMAND_POOL_CREATE_ONLY
                )
            )
        return pools

    def _autoscaled_pool(
        self,
        resource_name: str,
        args: AksClusterArgs,
        cluster: azure_native.containerservice.ManagedCluster,
        spec: dict[str, Any],
        create_only: tuple[str, ...] = GPU_POOL_CREATE_ONLY,
    ) -> azure_native.containerservice.AgentPool:
        """An autoscaled pool, never PUT after its create (AUTOSCALED_IGNORED): its bounds and
        its Kubernetes version change through `az aks nodepool` (``_in_place``)."""
        pool = azure_native.containerservice.AgentPool(
            resource_name,
            resource_group_name=args.resource_group_name,
            resource_name_=cluster.name,
            **spec,
            opts=pulumi.ResourceOptions(
                parent=self,
                # Belt and braces with the derived name: whatever a provider release decides for
                # these properties (pulumi-azure-native #3655 made some replace, #2774 dropped
                # others), a change to one replaces the pool instead of a refused update.
                replace_on_changes=[_camel(key) for key in create_only],
                ignore_changes=[_camel(key) for key in AUTOSCALED_IGNORED],
            ),
        )
        where = (cluster.name, spec["agent_pool_name"])
        bounds = (spec["min_count"], spec["max_count"])
        self._in_place(f"{resource_name}-bounds", args, pool, where, bounds, bounds_command)
        if version := spec.get("orchestrator_version"):
            self._in_place(f"{resource_name}-version", args, pool, where, version, upgrade_command)
        return pool

    def _in_place(
        self,
        resource_name: str,
        args: AksClusterArgs,
        after: pulumi.Resource,
        where: tuple[pulumi.Input[str], str],
        setting: Any,
        az_command: Callable[..., str],
    ) -> command.local.Command:
        """`az aks nodepool` applying a pool's setting when it changes (not on the pool's create).

        ``where`` is the cluster's and the pool's names; ``az_command`` takes the pool's
        ``PoolAddress`` and ``setting``. It runs after ``after`` (and so after the cluster): a
        new Kubernetes version reaches the control plane first, then the pools, the order AKS
        takes with a Spot pool present ("You can't upgrade the control plane and node pools at
        the same time", AKS, Spot node pools, Limitations).
        """
        address = pulumi.Output.all(
            args.resource_group_name, where[0], where[1], args.subscription_id
        ).apply(lambda v: PoolAddress(*v))
        settings = setting if isinstance(setting, tuple) else (setting,)
        return command.local.Command(
            resource_name,
            create=NO_OP,
            update=address.apply(lambda a: az_command(a, *settings)),
            # A changed setting runs `update` (pulumi-command: "If the `update` command was
            # provided the resource will be updated"), never `create` again.
            triggers=list(settings),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[after]),
        )

    def _upgrade_bootstrap_pool(
        self, name: str, args: AksClusterArgs, cluster: azure_native.containerservice.ManagedCluster
    ) -> None:
        """The inline bootstrap pool follows ``kubernetesVersion`` after the control plane: its
        own version is frozen in the cluster's state (INLINE_POOLS)."""
        version = args.cluster.kubernetes_version
        if version:
            where = (cluster.name, BOOTSTRAP_POOL_NAME)
            self._in_place(
                f"{name}-bootstrap-version", args, cluster, where, version, upgrade_command
            )

    def _kubeconfig(
        self, args: AksClusterArgs, cluster: azure_native.containerservice.ManagedCluster
    ) -> pulumi.Output[str]:
        """The kubeconfig that signs in as the deployer through kubelogin (no credential)."""
        credentials = azure_native.containerservice.list_managed_cluster_user_credentials_output(
            resource_group_name=args.resource_group_name,
            resource_name=cluster.name,
            format="exec",
            opts=pulumi.InvokeOutputOptions(parent=self),
        )
        # Secret although it holds no credential: it names the API server of the lab.
        text = credentials.kubeconfigs.apply(lambda kcs: decode_kubeconfig(kcs[0].value))
        return pulumi.Output.secret(
            pulumi.Output.all(text, args.admin_principal_type).apply(
                lambda values: deployer_kubeconfig(values[0], args.deployer, values[1])
            )
        )
