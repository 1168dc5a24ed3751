"""Every project config key, its type, and the ``LabConfig`` field it fills.

``Pulumi.yaml`` declares the same keys with their defaults and descriptions; a test holds the
two in step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One project config key and the ``LabConfig`` field it fills."""

    key: str
    """The key in Pulumi.yaml (without the project namespace)."""
    path: str
    """Dotted path of the field: ``gpu_pool.max_nodes``, ``job.rendezvous.join_timeout_s``."""
    kind: type
    """``str``, ``int``, ``bool`` or ``dict`` (a Pulumi object, JSON); spot price and Kubernetes
    version are strings, parsed here."""
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
    Setting("apiServerAuthorizedIpRanges", "cluster.api_server_authorized_ip_ranges", str),
    Setting("systemVmSize", "cluster.system_vm_size", str),
    Setting("systemNodeCount", "cluster.system_node_count", int),
    Setting("etcdMembers", "etcd_members", int),
    Setting("gpuVmSize", "gpu_pool.vm_size", str),
    Setting("rdma", "rdma", str),
    Setting("gpuMinNodes", "gpu_pool.min_nodes", int),
    Setting("gpuMaxNodes", "gpu_pool.max_nodes", int, optional=True),
    Setting("spotMaxPrice", "gpu_pool.spot_max_price", str),
    Setting("onDemandMaxNodes", "fallback.max_nodes", int),
    Setting("fallbackAfterMinutes", "fallback.after_minutes", int),
    Setting("workerMinReplicas", "job.min_replicas", int),
    Setting("workerMaxReplicas", "job.max_replicas", int),
    Setting("workerReplicas", "job.replicas", int),
    Setting("maxRestarts", "job.max_restarts", int),
    Setting("collectiveTimeoutSeconds", "job.collective_timeout_s", int),
    Setting("terminationGraceSeconds", "job.termination_grace_s", int),
    Setting("checkpointEverySteps", "job.checkpoint_every_steps", int),
    Setting("checkpointEverySeconds", "job.checkpoint_every_seconds", int),
    Setting("maxSteps", "job.max_steps", int),
    Setting("globalBatchSize", "job.global_batch_size", int),
    Setting("precision", "job.precision", str),
    Setting("parallelism", "job.parallelism", str),
    Setting("runId", "job.run_id", str),
    Setting("activeDeadlineSeconds", "job.active_deadline_s", int, optional=True),
    Setting("task", "task", str),
    Setting("dataSourceUrl", "data.source_url", str),
    Setting("dataSourceChecksum", "data.checksum", str),
    Setting("hpaCpuUtilization", "job.hpa_cpu_utilization", int),
    Setting("workerCpu", "job.worker_cpu", str, optional=True),
    Setting("workerMemory", "job.worker_memory", str, optional=True),
    Setting("rdzvLastCallTimeout", "job.rendezvous.last_call_timeout_s", int),
    Setting("rdzvKeepAliveInterval", "job.rendezvous.keep_alive_interval_s", int),
    Setting("rdzvKeepAliveMaxAttempt", "job.rendezvous.keep_alive_max_attempt", int),
    # Optional: unset, it follows the on-demand fallback (stack_config/fallback.py).
    Setting("rdzvJoinTimeout", "job.rendezvous.join_timeout_s", int, optional=True),
    Setting("taskPackage", "task_package", str),
    Setting("trainArgs", "job.train_args", dict),
    Setting("launcher", "job.launcher", str),
    Setting("script", "job.script", str),
    Setting("dataPrefix", "data.prefix", str),
    Setting("retainCheckpoints", "retain_checkpoints", bool),
)
KEYS: tuple[str, ...] = tuple(s.key for s in SETTINGS)
REMOVED: dict[str, str] = {
    "checkpointBackend": (
        "checkpoints always go through the Blob API with the workers' own identity: the Blob "
        "CSI mount cannot publish a manifest safely (its caches are per node and it has no "
        "create-if-absent); delete the key"
    ),
}
"""Keys of earlier versions, and why each went."""

IMAGE_BUILDERS = ("acr", "docker")
RDMA_MODES = ("auto", "on", "off")
