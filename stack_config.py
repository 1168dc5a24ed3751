"""The stack's configuration: one typed, validated object, read once in ``__main__.py``.

Defaults and descriptions live in ``Pulumi.yaml``; stack files override them. ``load()``
turns the raw key/value pairs into a frozen ``LabConfig`` and ``validate()`` checks every
rule before a single resource is registered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.launch import RendezvousSettings


class ConfigError(ValueError):
    """A stack config value is wrong; the message names the key and what is allowed."""


@dataclass(frozen=True)
class ClusterConfig:
    """AKS cluster and its CPU system pool (runs etcd, the operator, system pods)."""

    kubernetes_version: str | None = None
    """AKS version, e.g. "1.33"; None lets AKS pick its default."""
    system_vm_size: str = "Standard_D4s_v5"
    """CPU size of the system pool."""
    system_node_count: int = 2
    """System pool nodes; two keep etcd and the operator up through a node upgrade."""


@dataclass(frozen=True)
class GpuPoolConfig:
    """The GPU Spot pool the training workers run on."""

    vm_size: str = "Standard_NC4as_T4_v3"
    """A GPU VM size (NC/ND/NV families)."""
    min_nodes: int = 0
    """Autoscaler floor; 0 means no GPU cost when nothing trains."""
    max_nodes: int = 3
    """Autoscaler ceiling."""
    spot_max_price: float = -1.0
    """-1 pays up to the on-demand price (evicted only for capacity); else USD/hour > 0."""


@dataclass(frozen=True)
class JobConfig:
    """The elastic PyTorchJob."""

    min_replicas: int = 1
    max_replicas: int = 3
    replicas: int = 2
    """Workers the job asks for at start (min <= replicas <= max)."""
    max_restarts: int = 100
    """Every eviction costs each survivor one restart, so a long spot run needs many."""
    collective_timeout_s: int = 30
    """Collective (process-group) timeout: how long a frozen peer can stall the job."""
    checkpoint_backend: str = "mount"
    """"mount" (Blob CSI volume) or "blob" (azure-storage-blob, no fuse caches)."""
    checkpoint_every_steps: int = 100
    checkpoint_every_seconds: int = 300
    max_steps: int = 20000
    global_batch_size: int = 256
    hpa_cpu_utilization: int = 0
    """0: no HPA; else elasticPolicy.metrics targets this average CPU utilisation (%)."""
    worker_cpu: str = "3"
    worker_memory: str = "12Gi"
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)


@dataclass(frozen=True)
class LabConfig:
    """Everything ``pulumi up`` needs, validated."""

    project: str
    stack: str
    location: str = "westus3"
    name_prefix: str = "spotlab"
    namespace: str = "spot-lab"
    service_account: str = "trainer"
    """Training pods' ServiceAccount; the training identity's federated credential names it."""
    image_builder: str = "acr"
    """"acr" builds in the registry (no local Docker daemon); "docker" builds locally."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gpu_pool: GpuPoolConfig = field(default_factory=GpuPoolConfig)
    job: JobConfig = field(default_factory=JobConfig)
