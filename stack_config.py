"""The stack's configuration: one typed, validated object, read once in ``__main__.py``.

Defaults and descriptions live in ``Pulumi.yaml``; stack files override them. ``load()``
turns the raw key/value pairs into a frozen ``LabConfig`` and ``validate()`` checks every
rule before a single resource is registered. Both are pure: no pulumi import, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation

from infra import gpu_sizes, naming
from training.launch import RendezvousSettings
from training.stage_data import CHECKSUM


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
    system_vm_size: str = "Standard_D4s_v5"
    """CPU size of the system pool."""
    system_node_count: int = 2
    """System pool nodes; two keep etcd and the operator up through a node upgrade."""


@dataclass(frozen=True)
class GpuPoolConfig:
    """The GPU Spot pool the training workers run on."""

    vm_size: str = "Standard_NC4as_T4_v3"
    """An NVIDIA full-GPU size of a family in ``infra.gpu_sizes.FAMILIES``."""
    min_nodes: int = 0
    """Autoscaler floor; 0 means no GPU cost when nothing trains."""
    max_nodes: int | None = None
    """Autoscaler ceiling; None follows the job's max workers (see ``LabConfig.gpu_max_nodes``)."""
    spot_max_price: float = -1.0
    """-1 pays up to the on-demand price (evicted only for capacity); else USD/hour > 0."""


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
    checkpoint_backend: str = "mount"
    """"mount" (Blob CSI volume) or "blob" (azure-storage-blob, no fuse caches)."""
    checkpoint_every_steps: int = 100
    checkpoint_every_seconds: int = 300
    max_steps: int = 20000
    global_batch_size: int = 256
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

    @property
    def start_replicas(self) -> int:
        """``replicas`` clamped into [min, max]: new bounds alone never make the job invalid."""
        return min(max(self.replicas, self.min_replicas), self.max_replicas)


# The dataset's official source, and the MD5 its page publishes (binary version).
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_CHECKSUM = "md5:c32a1d4ab5d03f1284b67883e8d87530"
NO_STAGING = "none"


@dataclass(frozen=True)
class DataConfig:
    """Where ``pulumi up`` stages the dataset from, before the job may start."""

    source_url: str = CIFAR10_URL
    """An https URL of CIFAR-10's binary .tar.gz (or a mirror); "none": the user uploads."""
    checksum: str = CIFAR10_CHECKSUM
    """md5:<hex> or sha256:<hex> of the archive."""

    @property
    def staged(self) -> bool:
        """Whether ``pulumi up`` stages the data (else the user uploads it)."""
        return self.source_url != NO_STAGING


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
    job: JobConfig = field(default_factory=JobConfig)
    data: DataConfig = field(default_factory=DataConfig)

    @property
    def gpu_size(self) -> gpu_sizes.GpuSize:
        """The GPU size's entry in the shared table (``validate`` refuses any other size)."""
        size = gpu_sizes.gpu_size(self.gpu_pool.vm_size)
        if size is None:
            raise ValueError(f"{self.gpu_pool.vm_size} is not in infra.gpu_sizes.SIZES")
        return size

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


@dataclass(frozen=True)
class Setting:
    """One project config key and the ``LabConfig`` field it fills."""

    key: str
    """The key in Pulumi.yaml (without the project namespace)."""
    path: str
    """Dotted path of the field: ``gpu_pool.max_nodes``, ``job.rendezvous.join_timeout_s``."""
    kind: type
    """``str`` or ``int``; spot price and Kubernetes version are strings, parsed here."""
    optional: bool = False
    """An empty value means "not set" (None); Pulumi.yaml then declares it a string."""


# Every project config key; Pulumi.yaml declares the same keys with the same defaults.
SETTINGS: tuple[Setting, ...] = (
    Setting("location", "location", str),
    Setting("namePrefix", "name_prefix", str),
    Setting("namespace", "namespace", str),
    Setting("serviceAccount", "service_account", str),
    Setting("imageBuilder", "image_builder", str),
    Setting("kubernetesVersion", "cluster.kubernetes_version", str),
    Setting("systemVmSize", "cluster.system_vm_size", str),
    Setting("systemNodeCount", "cluster.system_node_count", int),
    Setting("gpuVmSize", "gpu_pool.vm_size", str),
    Setting("gpuMinNodes", "gpu_pool.min_nodes", int),
    Setting("gpuMaxNodes", "gpu_pool.max_nodes", int, optional=True),
    Setting("spotMaxPrice", "gpu_pool.spot_max_price", str),
    Setting("workerMinReplicas", "job.min_replicas", int),
    Setting("workerMaxReplicas", "job.max_replicas", int),
    Setting("workerReplicas", "job.replicas", int),
    Setting("maxRestarts", "job.max_restarts", int),
    Setting("collectiveTimeoutSeconds", "job.collective_timeout_s", int),
    Setting("checkpointBackend", "job.checkpoint_backend", str),
    Setting("checkpointEverySteps", "job.checkpoint_every_steps", int),
    Setting("checkpointEverySeconds", "job.checkpoint_every_seconds", int),
    Setting("maxSteps", "job.max_steps", int),
    Setting("globalBatchSize", "job.global_batch_size", int),
    Setting("runId", "job.run_id", str),
    Setting("activeDeadlineSeconds", "job.active_deadline_s", int, optional=True),
    Setting("dataSourceUrl", "data.source_url", str),
    Setting("dataSourceChecksum", "data.checksum", str),
    Setting("hpaCpuUtilization", "job.hpa_cpu_utilization", int),
    Setting("workerCpu", "job.worker_cpu", str, optional=True),
    Setting("workerMemory", "job.worker_memory", str, optional=True),
    Setting("rdzvLastCallTimeout", "job.rendezvous.last_call_timeout_s", int),
    Setting("rdzvKeepAliveInterval", "job.rendezvous.keep_alive_interval_s", int),
    Setting("rdzvKeepAliveMaxAttempt", "job.rendezvous.keep_alive_max_attempt", int),
    Setting("rdzvJoinTimeout", "job.rendezvous.join_timeout_s", int),
)
KEYS: tuple[str, ...] = tuple(s.key for s in SETTINGS)

CHECKPOINT_BACKENDS = ("mount", "blob")
IMAGE_BUILDERS = ("acr", "docker")


def _parse(setting: Setting, raw: str, project: str) -> object:
    """The typed value of one raw config string (spot price stays a float, version optional)."""
    key = f"{project}:{setting.key}"
    if setting.optional and not raw.strip():
        return None
    if setting.kind is int:
        try:
            return int(raw.strip())
        except ValueError:
            raise ConfigError([f"{key} must be an integer, got {raw!r}"]) from None
    if setting.key == "spotMaxPrice":
        return _parse_spot_price(raw, key)
    if setting.key == "kubernetesVersion":
        return raw.strip() or None
    return raw.strip()


def _parse_spot_price(raw: str, key: str) -> float:
    allowed = "-1 (pay up to the on-demand price) or a positive USD/hour, at most 5 decimals"
    try:
        price = Decimal(raw.strip())
    except InvalidOperation:
        raise ConfigError([f"{key} must be {allowed}, got {raw!r}"]) from None
    exponent = price.as_tuple().exponent
    decimals = -exponent if isinstance(exponent, int) and exponent < 0 else 0
    if not price.is_finite() or (price != -1 and (price <= 0 or decimals > 5)):
        raise ConfigError([f"{key} must be {allowed}, got {raw!r}"])
    return float(price)


def _with(obj: object, path: list[str], value: object) -> object:
    """A copy of a frozen dataclass tree with one nested field replaced."""
    if len(path) == 1:
        return replace(obj, **{path[0]: value})
    child = getattr(obj, path[0])
    return replace(obj, **{path[0]: _with(child, path[1:], value)})


def load(
    raw: Mapping[str, str], project: str, stack: str, location: str | None = None
) -> LabConfig:
    """Build a ``LabConfig`` from raw project config (keys without namespace, string values).

    Missing keys keep the dataclass defaults (equal to Pulumi.yaml's). ``location`` is the
    ``azure-native:location`` value; when set it wins over the project's ``location`` key.
    Unknown keys and unparseable values raise ``ConfigError``, all problems at once.
    """
    by_key = {s.key: s for s in SETTINGS}
    problems = [
        f"{project}:{key} is not a setting of this project; known keys: {', '.join(KEYS)}"
        for key in raw
        if key not in by_key
    ]
    cfg = LabConfig(project=project, stack=stack)
    for key, value in raw.items():
        if key not in by_key:
            continue
        try:
            cfg = _with(cfg, by_key[key].path.split("."), _parse(by_key[key], value, project))
        except ConfigError as err:
            problems.extend(err.problems)
    if location:
        cfg = replace(cfg, location=location.strip())
    if problems:
        raise ConfigError(problems)
    return cfg


def config_values(cfg: LabConfig) -> dict[str, object]:
    """Each key's effective value (for logs and for checking Pulumi.yaml's defaults)."""
    values: dict[str, object] = {}
    for setting in SETTINGS:
        value: object = cfg
        for part in setting.path.split("."):
            value = getattr(value, part)
        values[setting.key] = value
    return values


# ---- validation ------------------------------------------------------------------------------

CPU_VM_SIZE = re.compile(r"^Standard_[A-MO-Z]\w*$")
K8S_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")
REGION = re.compile(r"^[a-z][a-z0-9]+$")
# Becomes part of the storage account (3-24 lowercase alphanumerics) and registry names.
NAME_PREFIX = re.compile(r"^[a-z][a-z0-9]{1,11}$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
CPU_QUANTITY = re.compile(r"^(\d+(\.\d+)?|\d+m)$")
MEMORY_QUANTITY = re.compile(r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
# Goes into the rendezvous id and a label value: short, lowercase, no edge '-'.
RUN_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,18}[a-z0-9])?$")


def validate(cfg: LabConfig) -> None:
    """Raise ``ConfigError`` listing every broken rule, each naming its key and what is allowed."""
    problems = [
        *_naming_problems(cfg),
        *_cluster_problems(cfg),
        *_gpu_pool_problems(cfg),
        *_replica_problems(cfg),
        *_training_problems(cfg),
        *_data_problems(cfg),
    ]
    if problems:
        raise ConfigError(problems)


def _is_count(value: object) -> bool:
    """An int that is not a bool: anything else failed to parse and cannot be compared."""
    return isinstance(value, int) and not isinstance(value, bool)


def _counts(*values: object) -> bool:
    return all(_is_count(v) for v in values)


def _at_least(cfg: LabConfig, values: dict[str, int], low: int) -> list[str]:
    return [
        f"{cfg.key(key)} must be an integer >= {low}, got {value!r}"
        for key, value in values.items()
        if not _is_count(value) or value < low
    ]


def _one_of(cfg: LabConfig, key: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    if value in allowed:
        return []
    return [f"{cfg.key(key)} must be one of {', '.join(allowed)}; got {value!r}"]


def _naming_problems(cfg: LabConfig) -> list[str]:
    problems = []
    if not REGION.match(cfg.location):
        problems.append(
            f"azure-native:location (or {cfg.key('location')}) must be an Azure region name "
            f"such as westus3, got {cfg.location!r}"
        )
    if not NAME_PREFIX.match(cfg.name_prefix):
        problems.append(
            f"{cfg.key('namePrefix')} must be 2-12 lowercase letters or digits starting with a "
            "letter (it starts the storage account name: 3-24 lowercase alphanumerics, "
            f"globally unique), got {cfg.name_prefix!r}"
        )
    for key, value in (("namespace", cfg.namespace), ("serviceAccount", cfg.service_account)):
        if not DNS_LABEL.match(value):
            problems.append(
                f"{cfg.key(key)} must be a DNS label (1-63 lowercase letters, digits or '-', "
                f"starting and ending alphanumeric), got {value!r}"
            )
    problems += _stack_name_problems(cfg)
    return problems + _one_of(cfg, "imageBuilder", cfg.image_builder, IMAGE_BUILDERS)


def _stack_name_problems(cfg: LabConfig) -> list[str]:
    """Names built from the stack name must fit Azure's limits (never cut them short)."""
    too_long = [
        limit
        for limit in naming.name_limits(cfg.name_prefix, cfg.stack, cfg.location)
        if limit.too_long
    ]
    if not too_long:
        return []
    details = "; ".join(
        f"the {limit.what} {limit.name!r} would have {len(limit.name)} characters, "
        f"Azure allows {limit.limit}"
        for limit in too_long
    )
    longest = naming.longest_stack_name(cfg.name_prefix, cfg.location)
    prefix = cfg.key("namePrefix")
    return [
        f"stack name {cfg.stack!r} is too long: {details}. With {prefix} {cfg.name_prefix!r} "
        f"in {cfg.location} a stack name may have at most {longest} characters; use a shorter "
        f"stack name or {prefix}"
    ]


def _cluster_problems(cfg: LabConfig) -> list[str]:
    cluster = cfg.cluster
    problems = _at_least(cfg, {"systemNodeCount": cluster.system_node_count}, 1)
    version = cluster.kubernetes_version
    if version is not None and not K8S_VERSION.match(version):
        problems.append(
            f"{cfg.key('kubernetesVersion')} must be empty (AKS default) or a version such as "
            f"1.33 or 1.33.2, got {version!r}"
        )
    if not CPU_VM_SIZE.match(cluster.system_vm_size):
        problems.append(
            f"{cfg.key('systemVmSize')} must be a CPU VM size such as Standard_D4s_v5 "
            f"(not an N-series GPU size), got {cluster.system_vm_size!r}"
        )
    return problems


def _gpu_pool_problems(cfg: LabConfig) -> list[str]:
    pool = cfg.gpu_pool
    problems = _at_least(cfg, {"gpuMinNodes": pool.min_nodes}, 0)
    if pool.max_nodes is not None:
        problems += _at_least(cfg, {"gpuMaxNodes": pool.max_nodes}, 1)
    problems += _gpu_size_problems(cfg)
    # Compared even when another rule broke, so every problem shows up in one run.
    ceiling = cfg.gpu_max_nodes
    if _counts(pool.min_nodes, ceiling) and pool.min_nodes > ceiling:
        problems.append(f"{cfg.key('gpuMinNodes')} ({pool.min_nodes}) must be <= {_ceiling(cfg)}")
    if pool.spot_max_price != -1 and not pool.spot_max_price > 0:
        problems.append(
            f"{cfg.key('spotMaxPrice')} must be -1 (pay up to the on-demand price) or a "
            f"positive USD/hour, got {pool.spot_max_price!r}"
        )
    return problems


def _ceiling(cfg: LabConfig) -> str:
    """How the GPU pool's ceiling reads in a message: the key it came from and its value."""
    high = cfg.key("gpuMaxNodes")
    if cfg.gpu_pool.max_nodes is not None:
        return f"{high} ({cfg.gpu_pool.max_nodes})"
    return f"{cfg.key('workerMaxReplicas')} ({cfg.job.max_replicas}; {high} is unset)"


def _gpu_size_problems(cfg: LabConfig) -> list[str]:
    size = cfg.gpu_pool.vm_size
    if gpu_sizes.gpu_size(size):
        return []
    if gpu_sizes.gpu_family(size):
        known = ", ".join(
            s.name
            for s in gpu_sizes.SIZES
            if gpu_sizes.gpu_family(s.name) == (gpu_sizes.gpu_family(size))
        )
        return [
            f"{cfg.key('gpuVmSize')} {size!r} is not a size Azure offers in its family; "
            f"the family's sizes are: {known}"
        ]
    reason = gpu_sizes.rejection_reason(size)
    return [
        f"{cfg.key('gpuVmSize')} must be an NVIDIA full-GPU size of a family AKS installs the "
        f"driver for and the NVIDIA device plugin schedules: {gpu_sizes.allowed_families()}; "
        f"got {size!r}" + (f" ({size} is {reason})" if reason else "")
    ]


def _replica_problems(cfg: LabConfig) -> list[str]:
    job = cfg.job
    problems = _at_least(cfg, {"workerMinReplicas": job.min_replicas}, 1)
    problems += _at_least(
        cfg, {"workerMaxReplicas": job.max_replicas, "workerReplicas": job.replicas}, 1
    )
    problems += _at_least(cfg, {"maxRestarts": job.max_restarts}, 0)
    low, high = cfg.key("workerMinReplicas"), cfg.key("workerMaxReplicas")
    # workerReplicas has no range rule: the job starts with it clamped into [low, high].
    if _counts(job.min_replicas, job.max_replicas) and job.min_replicas > job.max_replicas:
        problems.append(f"{low} ({job.min_replicas}) must be <= {high} ({job.max_replicas})")
    # One worker per GPU node: each worker asks for a whole GPU. An unset gpuMaxNodes (None,
    # not a count) follows workerMaxReplicas, so there is nothing to compare.
    pool_max = cfg.gpu_pool.max_nodes
    if _counts(job.max_replicas, pool_max) and job.max_replicas > pool_max:
        problems.append(
            f"{high} ({job.max_replicas}) must be <= {cfg.key('gpuMaxNodes')} "
            f"({cfg.gpu_pool.max_nodes}): each worker needs its own GPU node"
        )
    return problems


def _training_problems(cfg: LabConfig) -> list[str]:
    job, rdzv = cfg.job, cfg.job.rendezvous
    problems = _one_of(cfg, "checkpointBackend", job.checkpoint_backend, CHECKPOINT_BACKENDS)
    positive = {
        "collectiveTimeoutSeconds": job.collective_timeout_s,
        "maxSteps": job.max_steps,
        "globalBatchSize": job.global_batch_size,
        "rdzvLastCallTimeout": rdzv.last_call_timeout_s,
        "rdzvKeepAliveInterval": rdzv.keep_alive_interval_s,
        "rdzvKeepAliveMaxAttempt": rdzv.keep_alive_max_attempt,
        "rdzvJoinTimeout": rdzv.join_timeout_s,
    }
    problems += _at_least(cfg, positive, 1)
    every = {
        "checkpointEverySteps": job.checkpoint_every_steps,
        "checkpointEverySeconds": job.checkpoint_every_seconds,
    }
    problems += _at_least(cfg, every, 0)
    if job.checkpoint_every_steps == 0 and job.checkpoint_every_seconds == 0:
        problems.append(
            f"{cfg.key('checkpointEverySteps')} and {cfg.key('checkpointEverySeconds')} are both "
            "0: no checkpoint would ever be saved; set at least one above 0"
        )
    size = gpu_sizes.gpu_size(cfg.gpu_pool.vm_size)
    gpus = size.gpus if size else 1
    if (
        _counts(job.global_batch_size, job.max_replicas)
        and job.global_batch_size < job.max_replicas * gpus
    ):
        problems.append(
            f"{cfg.key('globalBatchSize')} ({job.global_batch_size}) must be >= "
            f"{cfg.key('workerMaxReplicas')} ({job.max_replicas}) x {gpus} GPUs per "
            f"{cfg.gpu_pool.vm_size} node = {job.max_replicas * gpus}: every rank needs a sample"
        )
    if job.active_deadline_s is not None:
        problems += _at_least(cfg, {"activeDeadlineSeconds": job.active_deadline_s}, 1)
    if not RUN_ID.match(job.run_id):
        problems.append(
            f"{cfg.key('runId')} must be 1-20 lowercase letters, digits or '-', starting and "
            f"ending with a letter or digit (e.g. 2 or 2025-06-01), got {job.run_id!r}"
        )
    if not 0 <= job.hpa_cpu_utilization <= 100:
        problems.append(
            f"{cfg.key('hpaCpuUtilization')} must be 0 (no HPA) or a percentage 1-100, "
            f"got {job.hpa_cpu_utilization!r}"
        )
    return problems + _worker_resource_problems(cfg)


def _data_problems(cfg: LabConfig) -> list[str]:
    data = cfg.data
    if not data.staged:
        return []
    problems = []
    if not re.match(r"^https://[^/\s]+/\S+$", data.source_url):
        problems.append(
            f"{cfg.key('dataSourceUrl')} must be an https:// URL of CIFAR-10's binary .tar.gz "
            f"(default {CIFAR10_URL}) or {NO_STAGING!r} to upload the data yourself, "
            f"got {data.source_url!r}"
        )
    if not CHECKSUM.match(data.checksum.strip().lower()):
        problems.append(
            f"{cfg.key('dataSourceChecksum')} must be md5:<32 hex digits> or "
            f"sha256:<64 hex digits> of the archive, got {data.checksum!r}"
        )
    return problems


def _worker_resource_problems(cfg: LabConfig) -> list[str]:
    job, problems = cfg.job, []
    size = gpu_sizes.gpu_size(cfg.gpu_pool.vm_size)
    cpu_limit, memory_limit = gpu_sizes.worker_allocatable(size) if size else (None, None)
    if job.worker_cpu is not None:
        if not CPU_QUANTITY.match(job.worker_cpu):
            problems.append(
                f"{cfg.key('workerCpu')} must be a CPU quantity like 3, 2.5 or 500m (empty: "
                f"what the GPU size leaves), got {job.worker_cpu!r}"
            )
        elif cpu_limit is not None and _millicores(job.worker_cpu) > cpu_limit:
            problems.append(
                f"{cfg.key('workerCpu')} ({job.worker_cpu}) must fit on a {size.name} node, "
                f"which leaves {cpu_limit}m for the worker after AKS's reservations and the "
                "DaemonSets; leave it empty to request all of that"
            )
    if job.worker_memory is not None:
        if not MEMORY_QUANTITY.match(job.worker_memory):
            problems.append(
                f"{cfg.key('workerMemory')} must be a memory quantity like 12Gi or 512Mi "
                f"(empty: what the GPU size leaves), got {job.worker_memory!r}"
            )
        elif memory_limit is not None and _mebibytes(job.worker_memory) > memory_limit:
            problems.append(
                f"{cfg.key('workerMemory')} ({job.worker_memory}) must fit on a {size.name} "
                f"node, which leaves {memory_limit}Mi for the worker after AKS's reservations "
                "and the DaemonSets; leave it empty to request all of that"
            )
    return problems


_MEMORY_UNITS = {
    "": 1 / 1024**2,
    "Ki": 1 / 1024,
    "Mi": 1,
    "Gi": 1024,
    "Ti": 1024**2,
    "k": 1000 / 1024**2,
    "M": 1000**2 / 1024**2,
    "G": 1000**3 / 1024**2,
    "T": 1000**4 / 1024**2,
}


def _millicores(quantity: str) -> float:
    """A CPU quantity (``3``, ``2.5``, ``500m``) in millicores."""
    return float(quantity[:-1]) if quantity.endswith("m") else float(quantity) * 1000


def _mebibytes(quantity: str) -> float:
    """A memory quantity (``12Gi``, ``512Mi``, ``1G``) in MiB."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT])?", quantity)
    assert match is not None  # MEMORY_QUANTITY matched already
    return float(match.group(1)) * _MEMORY_UNITS[match.group(2) or ""]
