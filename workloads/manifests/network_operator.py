"""InfiniBand for the workers: NVIDIA's Network Operator, the way AKS documents it.

Azure/aks-rdma-infiniband ("Network Operator" configuration, the guide AKS points to for RDMA
over InfiniBand) installs the operator with Helm, chart ``nvidia/network-operator`` from
``https://helm.ngc.nvidia.com/nvidia`` at ``v26.4.0``, in a namespace labelled Pod Security
``privileged`` ("Network operator deploys pods that require privileged access to the host"),
with its Node Feature Discovery kept off the system pool (``configs/values/network-operator/
values.yaml``), and then a ``NicClusterPolicy``: the DOCA OFED driver on the nodes with Mellanox
NICs (``configs/nicclusterpolicy/base/nic.yaml``) and the RDMA shared device plugin, which
exposes every InfiniBand NIC of a node to its pods as ``rdma/shared_ib``
(``configs/nicclusterpolicy/rdma-shared-device-plugin/rdma.yaml``, "selectors": vendor 15b3,
link type infiniband). A worker asks for ``rdma/shared_ib: 1`` and adds ``IPC_LOCK`` ("A pod
without this will have a low locked memory value", the same guide). Pinned as that guide pins
them. Pure: builds plain dicts.
"""

from __future__ import annotations

import json
from typing import Any

from workloads.manifests.scheduling import gpu_spot_tolerations

NAMESPACE = "network-operator"
CHART = "network-operator"
CHART_REPOSITORY = "https://helm.ngc.nvidia.com/nvidia"
CHART_VERSION = "v26.4.0"
DOCA_DRIVER_VERSION = "doca3.2.0-25.10-1.2.8.0-2"
RDMA_PLUGIN_VERSION = "network-operator-v25.10.0"
RDMA_RESOURCE = "rdma/shared_ib"
"""What a worker requests: the shared plugin's ``resourceName`` under its ``rdma`` prefix."""
RDMA_PODS_PER_NODE = 63
"""The shared plugin's ``rdmaHcaMax``: pods per node that may hold the NICs at once."""
IPC_LOCK = "IPC_LOCK"
"""The capability NCCL's IB transport needs to pin (register) its buffers."""


def namespace_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": NAMESPACE,
            "labels": {"pod-security.kubernetes.io/enforce": "privileged"},
        },
    }


def _gpu_node_tolerations() -> list[dict[str, Any]]:
    """The driver and the plugin run on the GPU Spot pool's nodes: its taints."""
    return gpu_spot_tolerations()


def chart_values() -> dict[str, Any]:
    """The guide's values: NFD's workers off AKS's system-mode pool; and ours: they tolerate the
    GPU pools' taints, or they would never label the nodes the driver must go to."""
    not_system = {"key": "kubernetes.azure.com/mode", "operator": "NotIn", "values": ["system"]}
    return {
        "node-feature-discovery": {
            "worker": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [not_system]}]
                        }
                    }
                },
                "tolerations": _gpu_node_tolerations(),
            }
        }
    }


def nic_cluster_policy(vm_size: str) -> dict[str, Any]:
    """The driver and the shared RDMA plugin on the GPU nodes of ``vm_size`` (the cloud
    provider's ``node.kubernetes.io/instance-type``: only the InfiniBand size's nodes)."""
    config = {
        "configList": [
            {
                "resourceName": RDMA_RESOURCE.split("/")[1],
                "rdmaHcaMax": RDMA_PODS_PER_NODE,
                "selectors": {"vendors": ["15b3"], "linkTypes": ["infiniband"]},
            }
        ]
    }
    on_size = {
        "key": "node.kubernetes.io/instance-type",
        "operator": "In",
        "values": [vm_size],
    }
    return {
        "apiVersion": "mellanox.com/v1alpha1",
        "kind": "NicClusterPolicy",
        "metadata": {"name": "nic-cluster-policy"},
        "spec": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [on_size]}]
                }
            },
            # NicClusterPolicySpec's `Tolerations` go to the DaemonSets it creates
            # (Mellanox/network-operator, api/v1alpha1/nicclusterpolicy_types.go).
            "tolerations": _gpu_node_tolerations(),
            "ofedDriver": {
                "repository": "nvcr.io/nvidia/mellanox",
                "image": "doca-driver",
                "version": DOCA_DRIVER_VERSION,
                # The guide's workaround for a race in which the kernel module fails to load
                # (Mellanox/doca-driver-build #52).
                "env": [
                    {
                        "name": "OFED_BLACKLIST_MODULES_FILE",
                        "value": "/host/etc/modprobe.d/blacklist-ofed-modules.conf",
                    }
                ],
                "upgradePolicy": {"autoUpgrade": True, "maxParallelUpgrades": 1},
            },
            "rdmaSharedDevicePlugin": {
                "repository": "nvcr.io/nvidia/mellanox",
                "image": "k8s-rdma-shared-dev-plugin",
                "version": RDMA_PLUGIN_VERSION,
                "config": json.dumps(config),
            },
        },
    }


def with_infiniband(container: dict[str, Any], nccl_env: dict[str, str]) -> dict[str, Any]:
    """A worker container that uses its node's InfiniBand: ``nccl_env`` (the size's NCCL_IB_*
    settings, ``catalog.gpu_sizes.nccl_ib_env``), every NIC of the node (the shared plugin's one
    resource) and ``IPC_LOCK``. The container as it is when ``nccl_env`` is empty."""
    if not nccl_env:
        return container
    limits = {**container["resources"]["limits"], RDMA_RESOURCE: "1"}
    return {
        **container,
        "env": [*container["env"], *({"name": k, "value": v} for k, v in nccl_env.items())],
        "resources": {**container["resources"], "limits": limits},
        "securityContext": {"capabilities": {"add": [IPC_LOCK]}},
    }
