"""Every rule of the stack config, checked before a single resource is registered.

``validate`` reports every broken rule at once; each message names the key and what is allowed.
"""

from __future__ import annotations

import ipaddress
import re

from catalog import gpu_sizes, naming
from stack_config.etcd_members import etcd_member_problems
from stack_config.fallback import fallback_problems, gpu_node_total_problems
from stack_config.infiniband import rdma_problems
from stack_config.keys import IMAGE_BUILDERS
from stack_config.model import NO_STAGING, TASKS, ConfigError, LabConfig
from stack_config.task_package import package_problems
from training.settings import (
    CHECKSUM,
    MEASURED_HEARTBEATS_PER_S,
    PARALLELISMS,
    PRECISIONS,
    REFERENCE_FORM,
    SHARDABLE_TASKS,
    is_task_reference,
    termination_grace_problem,
)

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
        *fallback_problems(cfg),
        *gpu_node_total_problems(cfg),
        *_replica_problems(cfg),
        *_training_problems(cfg),
        *_data_problems(cfg),
        *package_problems(cfg),
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


def _is_ipv4_cidr(text: str) -> bool:
    """An IPv4 network with its prefix length, host bits clear (what AKS accepts)."""
    try:
        return "/" in text and ipaddress.ip_network(text, strict=True).version == 4
    except ValueError:
        return False


def _cluster_problems(cfg: LabConfig) -> list[str]:
    cluster = cfg.cluster
    problems = _at_least(cfg, {"systemNodeCount": cluster.system_node_count}, 1)
    problems += etcd_member_problems(cfg)
    version = cluster.kubernetes_version
    if version is not None and not K8S_VERSION.match(version):
        problems.append(
            f"{cfg.key('kubernetesVersion')} must be empty (AKS default) or a version such as "
            f"1.33 or 1.33.2, got {version!r}"
        )
    for entry in cluster.authorized_ip_ranges:
        if not _is_ipv4_cidr(entry):
            problems.append(
                f"{cfg.key('apiServerAuthorizedIpRanges')} must be comma-separated IPv4 CIDRs "
                f"such as 203.0.113.7/32 or 198.51.100.0/24, got {entry!r}"
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
    problems += rdma_problems(cfg)
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
    problems: list[str] = []
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
    if job.precision not in PRECISIONS:
        problems.append(
            f"{cfg.key('precision')} must be one of {', '.join(PRECISIONS)}, got {job.precision!r}"
        )
    if job.parallelism not in PARALLELISMS:
        allowed, got = ", ".join(PARALLELISMS), job.parallelism
        problems.append(f"{cfg.key('parallelism')} must be one of {allowed}, got {got!r}")
    elif job.parallelism == "fsdp2" and cfg.task in TASKS and cfg.task not in SHARDABLE_TASKS:
        problems.append(
            f"{cfg.key('parallelism')} fsdp2: {cfg.key('task')} {cfg.task} cannot be sharded "
            f"(fsdp2 tasks: {', '.join(sorted(SHARDABLE_TASKS))}); use ddp"
        )
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
    problems += _rendezvous_scale_problems(cfg)
    if job.active_deadline_s is not None:
        problems += _at_least(cfg, {"activeDeadlineSeconds": job.active_deadline_s}, 1)
    grace = termination_grace_problem(job.termination_grace_s)
    if grace is not None:
        problems.append(f"{cfg.key('terminationGraceSeconds')} {grace}")
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


def _rendezvous_scale_problems(cfg: LabConfig) -> list[str]:
    """More heartbeats a second than the rendezvous was measured with is refused, not hoped for."""
    job, rdzv = cfg.job, cfg.job.rendezvous
    if not _counts(job.max_replicas, rdzv.keep_alive_interval_s) or rdzv.keep_alive_interval_s < 1:
        return []
    rate = rdzv.heartbeats_per_s(job.max_replicas)
    if rate <= MEASURED_HEARTBEATS_PER_S:
        return []
    need = -(-job.max_replicas // MEASURED_HEARTBEATS_PER_S)  # ceiling
    return [
        f"{cfg.key('workerMaxReplicas')} ({job.max_replicas}) with "
        f"{cfg.key('rdzvKeepAliveInterval')} ({rdzv.keep_alive_interval_s}) is {rate:g} "
        f"heartbeats a second on etcd; the rendezvous is measured safe up to "
        f"{MEASURED_HEARTBEATS_PER_S} (docs/rendezvous.md): set {cfg.key('rdzvKeepAliveInterval')}"
        f" to {need} or more, or {cfg.key('workerMaxReplicas')} to "
        f"{MEASURED_HEARTBEATS_PER_S * rdzv.keep_alive_interval_s} or less"
    ]


def _data_problems(cfg: LabConfig) -> list[str]:
    if is_task_reference(cfg.task):
        # The user's own task: its module is imported in the image, not here; its data's
        # format is its own, which staging cannot check.
        if cfg.data.staged:
            return [
                f"{cfg.key('task')} {cfg.task} is a task of your own module: set "
                f"{cfg.key('dataSourceUrl')} to {NO_STAGING!r} and upload its data yourself "
                "(staging knows only the built-in tasks' formats)"
            ]
        return []
    if cfg.task not in TASKS:
        return [
            f"{cfg.key('task')} must be one of {', '.join(TASKS)}, or a TrainSpec of your own "
            f"module as {REFERENCE_FORM}, got {cfg.task!r}"
        ]
    if not cfg.data.staged:
        return []
    source, problems = cfg.data_source, []
    if not cfg.data.source_url and cfg.data.checksum:
        return [
            f"{cfg.key('dataSourceChecksum')} is set but {cfg.key('dataSourceUrl')} is empty "
            f"(the {cfg.task} task's own source, which has its own checksum): set both, or "
            "neither"
        ]
    if not re.match(r"^https://[^/\s]+/\S+$", source.url):
        problems.append(
            f"{cfg.key('dataSourceUrl')} must be an https:// URL of the {cfg.task} task's data "
            f"(empty: its own source, {cfg.key('task')}'s default), or {NO_STAGING!r} to upload "
            f"the data yourself, got {source.url!r}"
        )
    if not CHECKSUM.match(source.checksum.strip().lower()):
        problems.append(
            f"{cfg.key('dataSourceChecksum')} must be md5:<32 hex digits> or "
            f"sha256:<64 hex digits> of what {cfg.key('dataSourceUrl')} serves (required with "
            f"a URL of your own), got {source.checksum!r}"
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
