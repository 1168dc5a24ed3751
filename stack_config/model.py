"""The stack config's typed model: the frozen dataclasses ``pulumi up`` and the lab's tools read.

Pure, and below everything that uses the config: it imports
only the GPU-size table and the rendezvous settings, so no module here imports another back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from catalog import gpu_sizes
from training.settings import DEFAULT_TERMINATION_GRACE_S, SOURCES, DataSource, RendezvousSettings


class ConfigError(ValueError):
    """A stack config value is wrong; the message names the key and what is allowed."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid stack config:\n  " + "\n  ".join(self.problems))


@dataclass(frozen=True)
class ClusterConfig:
    """AKS cluster and its CPU system pool (runs etcd, the operator, system pods)."""

    kubernetes_version: str | None = None
    """AKS version, e.g. "1.33"; None lets AKS pick its default."""
    system_vm_size: str = "Standard_D2s_v5"
    """CPU size of the pool for etcd, the operator and data staging (not AKS's bootstrap pool)."""
    system_node_count: int = 3
    """Nodes of that pool, at least ``LabConfig.etcd_members``: one etcd member per node."""
    api_server_authorized_ip_ranges: str = ""
    """Comma-separated IPv4 CIDRs allowed to reach the API server; "" = any address."""

    @property
    def authorized_ip_ranges(self) -> list[str]:
        return [r.strip() for r in self.api_server_authorized_ip_ranges.split(",") if r.strip()]


@dataclass(frozen=True)
class GpuPoolConfig:
    """The GPU Spot pool the training workers run on."""

    vm_size: str = "Standard_NC4as_T4_v3"
    """An NVIDIA full-GPU size of a family in ``catalog.gpu_sizes.FAMILIES``."""
    min_nodes: int = 0
    """Autoscaler floor; 0 means no GPU cost when nothing trains."""
    max_nodes: int | None = None
    """Autoscaler ceiling; None follows the job's max workers (see ``LabConfig.gpu_max_nodes``)."""
    spot_max_price: float = -1.0
    """-1 pays up to the on-demand price (evicted only for capacity); else USD/hour > 0."""


@dataclass(frozen=True)
class FallbackConfig:
    """The optional on-demand pool of the GPU size: where the job grows when Spot has no
    capacity (``infra/node_pools.py``), preferred less than the Spot pool by the autoscaler."""

    max_nodes: int = 0
    """Autoscaler ceiling of the on-demand pool; 0 turns the fallback off."""
    after_minutes: int = 10
    """Minutes the cluster autoscaler gives the Spot pool to bring a node before it tries the
    on-demand pool (``autoScalerProfile.maxNodeProvisionTime``, which applies to every pool)."""

    @property
    def enabled(self) -> bool:
        return self.max_nodes > 0


@dataclass(frozen=True)
class JobConfig:
    """The elastic PyTorchJob."""

    min_replicas: int = 1
    max_replicas: int = 3
    replicas: int = 2
    """Workers the job asks for at start; clamped into [min, max] (``start_replicas``)."""
    max_restarts: int = 100
    """Every eviction costs each survivor one restart, so a long spot run needs many."""
    collective_timeout_s: int = 30
    """Collective (process-group) timeout: how long a frozen peer can stall the job."""
    checkpoint_every_steps: int = 100
    checkpoint_every_seconds: int = 300
    max_steps: int = 20000
    global_batch_size: int = 256
    precision: str = "fp32"
    """The workers' ``--precision``: fp32, bf16-mixed or fp16-mixed (training/loop/step/)."""
    parallelism: str = "ddp"
    """The workers' ``--parallelism``: ddp or fsdp2 (training/loop/parallel/)."""
    hpa_cpu_utilization: int = 0
    """0: no HPA; else elasticPolicy.metrics targets this average CPU utilisation (%)."""
    active_deadline_s: int | None = None
    """runPolicy.activeDeadlineSeconds: the operator fails the job (and frees its GPU nodes)
    this long after it started; None: no deadline."""
    run_id: str = "1"
    """Part of the rendezvous id: a new value starts a new run of the same job (same
    checkpoints), since a closed rendezvous stays closed for its id."""
    worker_cpu: str | None = None
    """CPU request of a worker pod; None: what the GPU size leaves allocatable."""
    worker_memory: str | None = None
    """Memory request (and limit) of a worker pod; None: what the GPU size leaves allocatable."""
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    termination_grace_s: int = DEFAULT_TERMINATION_GRACE_S
    """The worker pods' termination grace; the workers' stop deadline is derived from it."""
    train_args: Mapping[str, Any] = field(default_factory=dict)
    """``trainArgs``: flag name -> value for every worker: the loop's flags and the task's
    options (``launcher`` warm), or the script's arguments (``script``)."""
    launcher: str = "warm"
    """How the agent starts the workers: ``warm`` (forked from a warm server) or ``torchrun``
    (plain torchrun, which also runs an unported ``script``)."""
    script: str = ""
    """A plain torchrun script in the task package (a path inside it); needs launcher
    torchrun. "": the lab's own training loop."""

    @property
    def start_replicas(self) -> int:
        """``replicas`` clamped into [min, max]: new bounds alone never make the job invalid."""
        return min(max(self.replicas, self.min_replicas), self.max_replicas)


# CIFAR-10's official source, and the MD5 its page publishes (binary version).
CIFAR10_URL = SOURCES["cifar"].url
CIFAR10_CHECKSUM = SOURCES["cifar"].checksum
NO_STAGING = "none"
TASKS = tuple(SOURCES)
"""The tasks the image trains (training/tasks/), by the catalogue of their data sources."""


@dataclass(frozen=True)
class DataConfig:
    """Where ``pulumi up`` stages the dataset from, before the job may start."""

    source_url: str = ""
    """An https URL of the task's data (CIFAR-10's binary .tar.gz, a text corpus) or a
    mirror; "": the task's own source (``training/data/sources.py``); "none": the user
    uploads."""
    checksum: str = ""
    """md5:<hex> or sha256:<hex> of what ``source_url`` serves; "": the task's own source's."""
    prefix: str = ""
    """A folder of the data container the workers train from ("": all of it)."""

    @property
    def staged(self) -> bool:
        """Whether ``pulumi up`` stages the data (else the user uploads it)."""
        return self.source_url != NO_STAGING


@dataclass(frozen=True)
class TrainingRun:
    """What the workers run, as ``pulumi up`` resolved it from the task's source and
    ``trainArgs`` (``stack_config/task_package.py``): read once, before any resource."""

    flags: tuple[str, ...] = ()
    """``trainArgs`` as command-line arguments: ``--lr=0.0004`` for the loop, or a script's."""
    identity: Mapping[str, Any] = field(default_factory=dict)
    """The run's identity as ``up`` knows it: what a checkpoint must match to be resumed (the
    task, its state options, the seed, the global batch, the precision, the dtype)."""
    lineage: str = ""
    """Names the checkpoints' folder of this identity; "": the job's own folder (a built-in
    task at its default shape, whose every run shares it)."""
    package_dir: str = ""
    """The task package as an absolute path on the deployer's machine ("": none)."""


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
    stager_service_account: str = "data-stager"
    """The data-staging Job's ServiceAccount: the one identity that may write ``data``."""
    image_builder: str = "acr"
    """"acr" builds in the registry (no local Docker daemon); "docker" builds locally."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gpu_pool: GpuPoolConfig = field(default_factory=GpuPoolConfig)
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    job: JobConfig = field(default_factory=JobConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: str = "cifar"
    """What the job trains: a task of training/tasks/ (``TASKS``), or a TrainSpec of the
    user's own module in the image, as ``module.path:attribute``."""
    task_package: str = ""
    """A directory on the deployer's machine whose contents go on the image's import path
    (``/app``); "": the lab's image alone."""
    retain_checkpoints: bool = True
    """Whether ``pulumi destroy`` keeps the storage account and its checkpoints."""
    training: TrainingRun = field(default_factory=TrainingRun)
    """Resolved from the task's source and ``trainArgs`` after ``validate``."""
    rdma: str = "auto"
    """InfiniBand between the GPU nodes: auto (where the size has it), on or off."""
    etcd_members: int = 3
    """Members of the rendezvous' etcd, one per system node: 3 or 5 keep quorum through the loss
    of a node; 1 (a throwaway dev stack) is down while its node is."""

    @property
    def data_source(self) -> DataSource:
        """What staging downloads: the configured URL and checksum, or the task's own (the
        format is the task's either way)."""
        own = SOURCES.get(self.task, SOURCES["cifar"])
        if not self.data.source_url:
            return own
        return DataSource(self.data.source_url, self.data.checksum, own.format)

    @property
    def gpu_size(self) -> gpu_sizes.GpuSize:
        """The GPU size's entry in the shared table (``validate`` refuses any other size)."""
        size = gpu_sizes.gpu_size(self.gpu_pool.vm_size)
        if size is None:
            raise ValueError(f"{self.gpu_pool.vm_size} is not in catalog.gpu_sizes.SIZES")
        return size

    @property
    def infiniband(self) -> bool:
        """Whether the workers use the size's InfiniBand (``rdma``; ``validate`` refuses on
        for a size without it)."""
        size = gpu_sizes.gpu_size(self.gpu_pool.vm_size)
        return self.rdma != "off" and size is not None and size.infiniband is not None

    @property
    def nccl_ib_env(self) -> dict[str, str]:
        """The workers' NCCL_IB_* settings: the size's, with InfiniBand on; else none."""
        return gpu_sizes.nccl_ib_env(self.gpu_size) if self.infiniband else {}

    @property
    def gpus_per_node(self) -> int:
        """GPUs of one node: the worker pod asks for all of them and runs a process per GPU."""
        return self.gpu_size.gpus

    @property
    def worker_requests(self) -> tuple[str, str]:
        """(CPU, memory) of a worker pod: the configured values, or all the node leaves."""
        cpu_millis, memory_mib = gpu_sizes.worker_allocatable(self.gpu_size)
        cpu = self.job.worker_cpu or f"{cpu_millis // 100 * 100}m"
        memory = self.job.worker_memory or f"{memory_mib // 1024}Gi"
        return cpu, memory

    def key(self, name: str) -> str:
        """A config key as the user types it: ``spot-lab:gpuMaxNodes``."""
        return f"{self.project}:{name}"

    @property
    def gpu_max_nodes(self) -> int:
        """The GPU pool's autoscaler ceiling: gpuMaxNodes, or one node per worker when unset.

        One worker per GPU node, so by default the pool follows workerMaxReplicas and a new
        bound in the stack file resizes the pool, the PyTorchJob and its HPA together.
        """
        pool_max = self.gpu_pool.max_nodes
        return self.job.max_replicas if pool_max is None else pool_max
