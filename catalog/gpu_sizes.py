"""Which Azure GPU sizes the Spot pool can use: NVIDIA, whole GPUs, current, driver by AKS.

The pool asks AKS to install the NVIDIA driver (``gpuProfile.driver: Install``) and runs our
own NVIDIA device plugin; every worker asks for a whole ``nvidia.com/gpu``. That rules out
AMD GPUs (no NVIDIA driver or plugin), fractional GRID vGPUs (the plugin sees no CUDA
device), retired sizes (AKS cannot create them) and confidential H100s (they need the GPU
Operator's signed driver instead of AKS's). Pure: no pulumi import.

``SIZES`` is the one table of the sizes we accept, with their vCPUs, memory and GPUs: the pool,
the job (processes per node, GPU limit, requests), the config rules, and the lab's preflight
and price commands all read it. Figures from the Azure VM size pages, as AKS's own node-size
list repeats them (GiB of memory as Azure states it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuFamily:
    """One VM family the pool accepts."""

    name: str
    """Azure's family name, e.g. ``NCasT4_v3``."""
    pattern: re.Pattern[str]
    example: str
    """The family's smallest size."""


FAMILIES: tuple[GpuFamily, ...] = (
    GpuFamily("NCasT4_v3 (T4)", re.compile(r"^Standard_NC\d+as_T4_v3$"), "Standard_NC4as_T4_v3"),
    GpuFamily(
        "NCadsA10_v4 (A10)", re.compile(r"^Standard_NC\d+ads_A10_v4$"), "Standard_NC8ads_A10_v4"
    ),
    GpuFamily(
        "NCadsA100_v4 (A100 PCIe)",
        re.compile(r"^Standard_NC\d+ads_A100_v4$"),
        "Standard_NC24ads_A100_v4",
    ),
    GpuFamily(
        "NCadsH100_v5 (H100 NVL)",
        re.compile(r"^Standard_NC\d+adi?s_H100_v5$"),
        "Standard_NC40ads_H100_v5",
    ),
    GpuFamily(
        "NDasrA100_v4 (8x A100)", re.compile(r"^Standard_ND\d+asr_v4$"), "Standard_ND96asr_v4"
    ),
    GpuFamily(
        "NDamsrA100_v4 (8x A100 80GB)",
        re.compile(r"^Standard_ND\d+amsr_A100_v4$"),
        "Standard_ND96amsr_A100_v4",
    ),
    GpuFamily(
        "NDisrH100_v5 (8x H100)",
        re.compile(r"^Standard_ND\d+isr_H100_v5$"),
        "Standard_ND96isr_H100_v5",
    ),
    GpuFamily(
        "NDisrH200_v5 (8x H200)",
        re.compile(r"^Standard_ND\d+isr_H200_v5$"),
        "Standard_ND96isr_H200_v5",
    ),
)

# Sizes people reach for that cannot run this job, and why; checked in this order.
_REJECTED: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"^Standard_NC\d+r?s_v3$"),
        "NCv3 (V100), retired on 2025-09-30",
    ),
    (
        re.compile(r"^Standard_(NC\d+r?|NC\d+r?s_v2|ND\d+r?s|NV\d+)(_Promo)?$"),
        "of a retired family (NC, NCv2, ND or NV v1): AKS can no longer create it",
    ),
    (
        re.compile(r"^Standard_(NV\d+as_v4|NG\d+\w*_V620\w*|NV\d+\w*_V710\w*|ND\d+\w*MI300X\w*)$"),
        "an AMD GPU: AKS installs no NVIDIA driver and the NVIDIA device plugin finds no GPU",
    ),
    (
        re.compile(r"^Standard_NV\d+ad(m)?s_A10_v5$"),
        "an NVadsA10_v5 GRID vGPU size, made for graphics and mostly a fraction of an A10; "
        "for A10 compute use NCadsA10_v4",
    ),
    (
        re.compile(r"^Standard_NCC\d+\w*$"),
        "a confidential GPU: it needs the NVIDIA GPU Operator's signed driver, not AKS's",
    ),
)


@dataclass(frozen=True)
class InfiniBand:
    """A size's InfiniBand: the links RDMA traffic between nodes takes instead of Ethernet."""

    links: int
    """Mellanox ConnectX NICs, one per GPU on the ND sizes."""
    gbps: int
    """Each link's rate."""
    hca_prefix: str = "mlx5"
    """What NCCL_IB_HCA matches: the mlx5 driver's devices. In the worker's container only the
    InfiniBand devices the RDMA device plugin hands it are there (its selector takes link type
    infiniband, not the Ethernet VF of accelerated networking, which is mlx5 too)."""


@dataclass(frozen=True)
class GpuSize:
    """One VM size the pool accepts: what a node of it has."""

    name: str
    """Azure's size name, e.g. ``Standard_NC24ads_A100_v4``."""
    vcpus: int
    memory_gib: int
    gpus: int
    """Whole NVIDIA GPUs: the node runs this many training processes."""
    gpu_model: str
    infiniband: InfiniBand | None = None
    """None: the size's nodes talk over Ethernet only."""

    @property
    def family(self) -> GpuFamily:
        """The accepted family of this size."""
        family = gpu_family(self.name)
        assert family is not None, self.name  # the table holds accepted sizes only
        return family


SIZES: tuple[GpuSize, ...] = (
    GpuSize("Standard_NC4as_T4_v3", 4, 28, 1, "T4"),
    GpuSize("Standard_NC8as_T4_v3", 8, 56, 1, "T4"),
    GpuSize("Standard_NC16as_T4_v3", 16, 110, 1, "T4"),
    GpuSize("Standard_NC64as_T4_v3", 64, 440, 4, "T4"),
    GpuSize("Standard_NC8ads_A10_v4", 8, 110, 1, "A10"),
    GpuSize("Standard_NC16ads_A10_v4", 16, 220, 1, "A10"),
    GpuSize("Standard_NC32ads_A10_v4", 32, 440, 2, "A10"),
    GpuSize("Standard_NC24ads_A100_v4", 24, 220, 1, "A100 80GB PCIe"),
    GpuSize("Standard_NC48ads_A100_v4", 48, 440, 2, "A100 80GB PCIe"),
    GpuSize("Standard_NC96ads_A100_v4", 96, 880, 4, "A100 80GB PCIe"),
    GpuSize("Standard_NC40ads_H100_v5", 40, 320, 1, "H100 NVL"),
    GpuSize("Standard_NC80adis_H100_v5", 80, 640, 2, "H100 NVL"),
    # The ND sizes' InfiniBand, from their size pages: ND A100 v4 and NDm A100 v4 "8x 200 Gigabit
    # Mellanox HDR InfiniBand", ND H100 v5 and ND H200 v5 "8x 400 Gb/s NVIDIA Quantum-2 CX7
    # InfiniBand" (Azure, "ND family" sizes); the "r" in the name is "RDMA capable"
    # (Azure/aks-rdma-infiniband, "Prerequisites", VM size naming).
    GpuSize("Standard_ND96asr_v4", 96, 900, 8, "A100 40GB SXM", InfiniBand(8, 200)),
    GpuSize("Standard_ND96amsr_A100_v4", 96, 1900, 8, "A100 80GB SXM", InfiniBand(8, 200)),
    GpuSize("Standard_ND96isr_H100_v5", 96, 1900, 8, "H100 SXM", InfiniBand(8, 400)),
    GpuSize("Standard_ND96isr_H200_v5", 96, 1850, 8, "H200 SXM", InfiniBand(8, 400)),
)
_BY_NAME = {size.name.lower(): size for size in SIZES}


def gpu_size(vm_size: str) -> GpuSize | None:
    """The table's entry for ``vm_size`` (Azure size names are case-insensitive), or None."""
    return _BY_NAME.get(vm_size.lower())


def gpu_family(vm_size: str) -> GpuFamily | None:
    """The accepted family ``vm_size`` belongs to, or None."""
    return next((f for f in FAMILIES if f.pattern.match(vm_size)), None)


def rejection_reason(vm_size: str) -> str | None:
    """Why a known but unusable size is refused (None: not one we recognise)."""
    return next((why for pattern, why in _REJECTED if pattern.match(vm_size)), None)


def allowed_families() -> str:
    """The accepted families with an example each, for error messages."""
    return ", ".join(f"{f.name} e.g. {f.example}" for f in FAMILIES)


def nccl_ib_env(size: GpuSize) -> dict[str, str]:
    """The NCCL settings of a size's InfiniBand (NCCL, "Environment Variables"): use it
    (``NCCL_IB_DISABLE=0``, as Azure/aks-rdma-infiniband's tests set it), on the HCAs whose
    names start with the catalogue's prefix (``NCCL_IB_HCA``: "a list of prefixes"), with
    Relaxed Ordering, which "can greatly help the performance of InfiniBand networks in
    virtualized environments" (``NCCL_IB_PCI_RELAXED_ORDERING``; an Azure VM is one), and its
    bootstrap on the pod's own interface (``NCCL_SOCKET_IFNAME``). {} for a size without."""
    ib = size.infiniband
    if ib is None:
        return {}
    return {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": ib.hca_prefix,
        "NCCL_IB_PCI_RELAXED_ORDERING": "1",
        "NCCL_SOCKET_IFNAME": "eth0",
    }


# ---- what a node of a size leaves for the worker pod ---------------------------------------------
# AKS "Node resource reservations" (Resource reservations, AKS core concepts): kube-reserved CPU is
# 60m for 1 core, 100m for 2, 140m for 4, then 10m per core more (180m for 8, 260m for 16, 420m
# for 32, 740m for 64); kube-reserved memory (AKS >= 1.29) is 20 MB per allowed pod plus 50 MB,
# with max pods 250 by default under Azure CNI Overlay, and the kubelet evicts below 100Mi free.
# What is left is the node's allocatable: what the scheduler hands out to requests.
MAX_PODS = 250
EVICTION_THRESHOLD_MIB = 100
# And the memory the VM does not show the OS (a few %).
VISIBLE_MEMORY = 0.97


@dataclass(frozen=True)
class NodeDaemonSet:
    """A DaemonSet every GPU node of the cluster runs, with what its pod requests."""

    name: str
    cpu_millis: int
    memory_mib: int
    source: str
    """Where the requests are from."""


# The DaemonSets' requests come out of the allocatable before the worker's. Those of AKS's own
# add-ons on this cluster (Azure CNI Overlay with Cilium, the Blob CSI driver on), and Azure
# Monitor's agent, the add-on users most often turn on:
NODE_DAEMONSETS: tuple[NodeDaemonSet, ...] = (
    NodeDaemonSet("cilium", 0, 100, "Azure/AKS #5244: only its init container requests 100Mi"),
    NodeDaemonSet(
        "azure-cns", 0, 250, "Azure/AKS #3525: 550 MB for azure-cns and azure-npm (300Mi, #2033)"
    ),
    NodeDaemonSet("cloud-node-manager", 50, 50, "a node's pod list in Azure/AKS #5251"),
    # Three containers of 10m/20Mi each, as azuredisk-csi's (Azure/AKS #5251).
    NodeDaemonSet("csi-azuredisk-node", 30, 60, "Azure/AKS #5251"),
    NodeDaemonSet("csi-azurefile-node", 30, 60, "Azure/AKS #5251"),
    NodeDaemonSet("csi-blob-node", 30, 60, "Azure/AKS #5251"),
    NodeDaemonSet(
        "ama-logs (Azure Monitor)",
        150,
        550,
        "microsoft/Docker-Provider, charts/azuremonitor-containers/values.yaml: 75m/325Mi and a "
        "sidecar of 75m/225Mi",
    ),
)
# The reserve: the DaemonSets above (290m, 1130Mi) and room for what is not itemized for want
# of a source (ip-masq-agent, Microsoft Defender's sensor, the CNS's CPU) or comes with a newer
# AKS release. A worker that still does not fit is said plainly by `lab watch`
# (lab/azure/cluster/capacity_lines.py), and workerCpu/workerMemory set a lower request.
DAEMONSET_CPU_MILLIS = 800
DAEMONSET_MEMORY_MIB = 2048


def kube_reserved_cpu_millis(vcpus: int) -> int:
    """AKS's kube-reserved CPU for a node with ``vcpus`` cores."""
    if vcpus <= 1:
        return 60
    if vcpus <= 2:
        return 100
    return 140 + 10 * max(vcpus - 4, 0)


def node_allocatable(size: GpuSize) -> tuple[int, int]:
    """(millicores, MiB) a node of ``size`` has allocatable, as AKS reserves."""
    cpu = size.vcpus * 1000 - kube_reserved_cpu_millis(size.vcpus)
    reserved_mib = (20 * MAX_PODS + 50) * 1000**2 // 1024**2 + EVICTION_THRESHOLD_MIB
    return cpu, int(size.memory_gib * 1024 * VISIBLE_MEMORY) - reserved_mib


def worker_allocatable(size: GpuSize) -> tuple[int, int]:
    """(millicores, MiB) one worker pod may request on a node of ``size``: the allocatable less
    the DaemonSets' reserve."""
    cpu, memory = node_allocatable(size)
    return cpu - DAEMONSET_CPU_MILLIS, memory - DAEMONSET_MEMORY_MIB
