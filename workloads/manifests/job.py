"""The elastic PyTorchJob: Worker pods only, torchrun in each, rendezvous in etcd.

The Kubeflow operator turns ``elasticPolicy`` into ``PET_*`` env and torchrun reads those as
its flags, so the values here are the same ``ElasticPolicy`` and ``worker_env`` the local
lab gives its agents (``training/elastic/launch.py``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from catalog.pool_labels import gpu_generation_selector, gpu_pool_selector
from stack_config import LabConfig
from training.elastic.launch import (
    DATA_DIR_ENV,
    DATA_URI_ENV,
    DEFAULT_TERMINATION_GRACE_S,
    EVICTION_NOTICE_S,
    STOP_MARGIN_S,
    ElasticPolicy,
    RendezvousSettings,
    stop_deadline_s,
    termination_grace_problem,
    worker_env,
)
from workloads.manifests.namespace import WORKLOAD_IDENTITY_USE
from workloads.manifests.network_operator import with_infiniband
from workloads.manifests.scheduling import (
    GPU_SPOT_POOL,
    TRAINER_LABELS,
    gpu_spot_tolerations,
    node_loss_tolerations,
    spot_preference,
)
from workloads.manifests.worker_program import WorkerProgram, data_uri, worker_command

PYTORCHJOB_API_VERSION = "kubeflow.org/v1"
PYTORCHJOB_KIND = "PyTorchJob"
LOCAL_MOUNT = "/mnt/local"
LOCAL_DATA_DIR = f"{LOCAL_MOUNT}/data"
"""Where the agent copies the dataset before it joins (``training/data/fetch_data.py``)."""
DATASET_MOUNT = "/mnt/dataset"
"""Where the dataset's read-only Blob CSI volume is mounted; the agent copies from it."""
CONTAINER_NAME = "pytorch"
"""The operator's webhook requires a container with this name."""
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
"""The operator puts this label on every pod of a job."""
RUN_ID_LABEL = "spot-lab/run-id"
"""On the job and its pods: which run (``runId``) they belong to."""
# Added after rendezvous ids were in use: left out of the id's hash at these defaults.
_ADDED_FIELDS = {
    "prefer_spot": False,
    "program": asdict(WorkerProgram()),
    "nccl_ib_env": {},
    "etcd_members": (),
}


@dataclass(frozen=True)
class ElasticJobSpec:
    """Everything that shapes the PyTorchJob; ``pytorchjob_manifest`` turns it into a dict."""

    name: str
    namespace: str
    image: str
    """Full image reference with its content-hash tag: a new tag is a new job."""
    rdzv_host: str
    """DNS name of the etcd client Service."""
    min_replicas: int
    max_replicas: int
    replicas: int
    """Workers requested at start (min <= replicas <= max)."""
    max_restarts: int
    service_account: str
    priority_class: str
    data_claim: str
    """PVC of the dataset's Blob CSI volume: mounted read-only at ``DATASET_MOUNT``, which the
    agent copies to the pod's disk before it joins (TRAIN_DATA_URI)."""
    checkpoint_uri: str
    """TRAIN_CHECKPOINT_URI: the https:// Blob URL the workers write through the Blob API."""
    max_steps: int
    global_batch_size: int
    checkpoint_every_steps: int
    checkpoint_every_seconds: int
    collective_timeout_s: int
    worker_cpu: str
    worker_memory: str
    hpa_cpu_utilization: int = 0
    """0: no HPA; else the operator's HPA targets this average CPU utilisation (%)."""
    run_id: str = "1"
    """Which run of this job: part of the rendezvous id and of the labels."""
    active_deadline_s: int | None = None
    """runPolicy.activeDeadlineSeconds; None: no deadline."""
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    gpus_per_worker: int = 1
    """GPUs per pod; torchrun starts one process per GPU (nprocPerNode)."""
    shm_size: str = "2Gi"
    termination_grace_s: int = DEFAULT_TERMINATION_GRACE_S
    """The pods' terminationGracePeriodSeconds; the workers' stop deadline derives from it."""
    node_selector: dict[str, str] = field(default_factory=lambda: dict(GPU_SPOT_POOL))
    task: str = "cifar"
    """What the workers train (``--task``: training/tasks/)."""
    precision: str = "fp32"
    """The workers' ``--precision``: fp32, bf16-mixed or fp16-mixed."""
    parallelism: str = "ddp"
    """The workers' ``--parallelism``: ddp or fsdp2."""
    prefer_spot: bool = False
    """With the on-demand fallback: the selector admits both GPU pools of the generation and the
    workers prefer the Spot one (``spot_preference``)."""
    program: WorkerProgram = field(default_factory=WorkerProgram)
    """What the workers run (the loop or a script, with the stack's flags) and its data's folder."""
    nccl_ib_env: dict[str, str] = field(default_factory=dict)  # rdma: the size's NCCL_IB_*
    etcd_members: tuple[str, ...] = ()
    """Each etcd member's ``host:port`` (the rendezvous conf's ``etcd_members``)."""

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed values."""
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"replicas ({self.replicas}) must be within "
                f"[min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]"
            )
        if termination_grace_problem(self.termination_grace_s):
            low, high = STOP_MARGIN_S + 1, EVICTION_NOTICE_S - 1
            raise ValueError(
                f"termination_grace_s must be in {low}..{high} (inside Azure's "
                f"{EVICTION_NOTICE_S} s eviction notice, the workers' stop deadline "
                f"{STOP_MARGIN_S} s inside it), got {self.termination_grace_s}"
            )
        if not 0 <= self.hpa_cpu_utilization <= 100:
            raise ValueError(
                "hpa_cpu_utilization must be 0 (no HPA) or a percentage 1-100, "
                f"got {self.hpa_cpu_utilization}"
            )
        if self.gpus_per_worker < 1:
            raise ValueError(f"gpus_per_worker must be >= 1, got {self.gpus_per_worker}")
        if not self.image or ":" not in self.image.rsplit("/", 1)[-1]:
            raise ValueError(f"image must carry an explicit tag, got {self.image!r}")
        elastic_policy(self).validate()


def rendezvous_id(spec: ElasticJobSpec) -> str:
    """A rendezvous id unique to this run, image and spec: ``<job>-<run id>-<hash>``.

    A rendezvous closed by an orderly shutdown (or an exhausted restart budget) stays closed
    for its id, so a reused id would hang the next job. Hashing the whole spec, image tag
    and run id included, gives every new image, spec or run a fresh id while an unchanged
    one keeps its id (fields added after ids were in use count only when set). Re-creating an
    identical job (after it finished, or after ``kubectl delete``) needs a new ``runId``.
    """
    fields = asdict(spec)
    for name, default in _ADDED_FIELDS.items():  # so every existing job keeps its id
        if fields[name] == default:
            del fields[name]
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    return f"{spec.name}-{spec.run_id}-{digest}"


def elastic_policy(spec: ElasticJobSpec) -> ElasticPolicy:
    """The launch contract the operator hands to torchrun as ``PET_*`` env."""
    return ElasticPolicy(
        rdzv_host=spec.rdzv_host,
        etcd_members=spec.etcd_members,
        rdzv_id=rendezvous_id(spec),
        min_nodes=spec.min_replicas,
        max_nodes=spec.max_replicas,
        max_restarts=spec.max_restarts,
        nproc_per_node=spec.gpus_per_worker,
        rendezvous=spec.rendezvous,
    )


def hpa_metrics(cpu_utilization: int) -> list[dict[str, Any]]:
    """autoscaling/v2 MetricSpecs for the operator's HPA: average CPU utilisation."""
    return [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": cpu_utilization},
            },
        }
    ]


def elastic_policy_manifest(spec: ElasticJobSpec) -> dict[str, Any]:
    """``spec.elasticPolicy``: the etcd rendezvous, node bounds and restart budget."""
    policy = elastic_policy(spec)
    manifest: dict[str, Any] = {
        "rdzvBackend": policy.pet_env()["PET_RDZV_BACKEND"],
        "rdzvHost": policy.rdzv_host,
        "rdzvPort": policy.rdzv_port,
        "rdzvId": policy.rdzv_id,
        "rdzvConf": [{"key": k, "value": v} for k, v in policy.rdzv_conf().items()],
        "minReplicas": policy.min_nodes,
        "maxReplicas": policy.max_nodes,
        "maxRestarts": policy.max_restarts,
    }
    if spec.hpa_cpu_utilization > 0:
        manifest["metrics"] = hpa_metrics(spec.hpa_cpu_utilization)
    return manifest


def training_args(spec: ElasticJobSpec) -> list[str]:
    """Flags of ``training.train``; checkpoint location and timeouts come as env."""
    return [
        f"--task={spec.task}",
        f"--max-steps={spec.max_steps}",
        f"--global-batch-size={spec.global_batch_size}",
        f"--precision={spec.precision}",
        f"--parallelism={spec.parallelism}",
        f"--checkpoint-every-steps={spec.checkpoint_every_steps}",
        f"--checkpoint-every-seconds={spec.checkpoint_every_seconds}",
        # The eviction's save is done or given up before the kubelet's SIGKILL.
        f"--stop-deadline-s={stop_deadline_s(spec.termination_grace_s)}",
    ]


def _worker_container(spec: ElasticJobSpec) -> dict[str, Any]:
    env = worker_env(
        checkpoint_uri=spec.checkpoint_uri,
        local_dir=LOCAL_MOUNT,
        collective_timeout_s=spec.collective_timeout_s,
        launcher=spec.program.launcher,
    )
    # The agent copies the dataset from the read-only Blob CSI mount to the pod's disk when the
    # pod starts: the mount's token is fresh then on every driver version (before v1.27 it is
    # never refreshed, catalog/blob_csi.py), and training reads local disk, not FUSE.
    env |= {DATA_URI_ENV: data_uri(spec.program, DATASET_MOUNT), DATA_DIR_ENV: LOCAL_DATA_DIR}
    mounts = [
        {"name": "dataset", "mountPath": DATASET_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "local", "mountPath": LOCAL_MOUNT},
    ]
    return {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": worker_command(spec.program, training_args(spec)),
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "resources": {
            "requests": {"cpu": spec.worker_cpu, "memory": spec.worker_memory},
            "limits": {"nvidia.com/gpu": str(spec.gpus_per_worker), "memory": spec.worker_memory},
        },
        "volumeMounts": mounts,
    }


def _worker_volumes(spec: ElasticJobSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        # Read-only twice over: the PV is ReadOnlyMany (blobfuse2 gets -o ro) and so is the claim.
        {
            "name": "dataset",
            "persistentVolumeClaim": {"claimName": spec.data_claim, "readOnly": True},
        },
        # DataLoader workers and NCCL pass tensors through /dev/shm; the runtime's 64 MiB
        # default breaks both.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        # Node-local disk for the dataset copy and the emergency saves: both survive a
        # container restart in the same pod.
        {"name": "local", "emptyDir": {}},
    ]
    return volumes


def worker_pod_template(spec: ElasticJobSpec) -> dict[str, Any]:
    """The Worker pod: one GPU, on the GPU Spot pool, preemptible, with workload identity."""
    return {
        "metadata": {
            "labels": {**TRAINER_LABELS, **WORKLOAD_IDENTITY_USE, RUN_ID_LABEL: spec.run_id}
        },
        "spec": {
            "serviceAccountName": spec.service_account,
            "priorityClassName": spec.priority_class,
            "terminationGracePeriodSeconds": spec.termination_grace_s,
            "nodeSelector": dict(spec.node_selector),
            **({"affinity": spot_preference()} if spec.prefer_spot else {}),
            # The Spot taint's toleration is harmless on the on-demand pool, which lacks it.
            "tolerations": [*gpu_spot_tolerations(), *node_loss_tolerations()],
            "containers": [with_infiniband(_worker_container(spec), spec.nccl_ib_env)],
            "volumes": _worker_volumes(spec),
        },
    }


def pytorchjob_manifest(spec: ElasticJobSpec) -> dict[str, Any]:
    """The elastic PyTorchJob (kubeflow.org/v1) for ``spec``."""
    spec.validate()
    return {
        "apiVersion": PYTORCHJOB_API_VERSION,
        "kind": PYTORCHJOB_KIND,
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": {"app.kubernetes.io/part-of": "spot-lab", RUN_ID_LABEL: spec.run_id},
        },
        "spec": {
            "nprocPerNode": str(spec.gpus_per_worker),
            "elasticPolicy": elastic_policy_manifest(spec),
            "runPolicy": run_policy(spec),
            "pytorchReplicaSpecs": {
                # Elastic jobs have no Master: every worker is equal and rank 0 is whoever
                # the rendezvous picks, so losing any one pod is survivable.
                "Worker": {
                    "replicas": spec.replicas,
                    # ExitCode: operator v1.9.4 recreates the pod for every exit code >= 128
                    # and fails the job on 1-127 (pkg/util/train/train_util.go,
                    # IsRetryableExitCode: `return exitCode >= 128`). So an eviction (143), a
                    # kill (137) and our "retry me" (138) get a new pod, and a bad flag or
                    # missing data (2) stops the job and frees its GPU nodes; but a crash by
                    # signal (134 SIGABRT, 139 SIGSEGV) is retried too, with no limit:
                    # runPolicy.activeDeadlineSeconds is what bounds that (run_policy).
                    # training/elastic/exit_codes.py maps every way a node ends onto these codes.
                    "restartPolicy": "ExitCode",
                    "template": worker_pod_template(spec),
                }
            },
        },
    }


def run_policy(spec: ElasticJobSpec) -> dict[str, Any]:
    """The job's runPolicy: keep finished pods, and an optional deadline.

    Finished pods stay (the operator's default, stated): their logs tell how a run ended. No
    backoffLimit: the operator counts only container restarts of running pods against it
    (common job controller, ``PastBackoffLimit``), and under ExitCode a retried failure is a
    new pod, so it would bound nothing; the exit codes and torchrun's ``maxRestarts`` do.
    The one loop nothing else ends is a pod that keeps dying by a signal (134, 139: retried
    as >= 128); ``activeDeadlineSeconds`` ends the job that long after it started whatever its
    pods do (``PastActiveDeadline``: now - status.startTime >= the deadline). No default: the
    right bound is a multiple of the run's length, which the lab cannot know (docs/azure.md).
    """
    policy: dict[str, Any] = {"cleanPodPolicy": "None"}
    if spec.active_deadline_s is not None:
        policy["activeDeadlineSeconds"] = spec.active_deadline_s
    return policy


def elastic_job_spec(
    config: LabConfig,
    *,
    image: str,
    rdzv_host: str,
    etcd_members: tuple[str, ...] = (),
    priority_class: str,
    data_claim: str,
    checkpoint_uri: str,
    gpu_pool: str,
) -> ElasticJobSpec:
    """The job spec the stack config asks for; the job is ``<prefix>-train``.

    ``gpu_pool`` is the GPU pool's AgentPool name: the workers select that generation only, so
    after a size change they never land on the old pool, which is deleted last. With the
    on-demand fallback they select both pools of the generation and prefer the Spot one.
    """
    job, fallback = config.job, config.fallback.enabled
    return ElasticJobSpec(
        name=job_name(config),
        namespace=config.namespace,
        image=image,
        rdzv_host=rdzv_host,
        etcd_members=tuple(etcd_members),
        min_replicas=job.min_replicas,
        max_replicas=job.max_replicas,
        # Clamped into [min, max]: a new bound in the stack file never strands the start size.
        replicas=job.start_replicas,
        max_restarts=job.max_restarts,
        service_account=config.service_account,
        priority_class=priority_class,
        data_claim=data_claim,
        checkpoint_uri=checkpoint_uri,
        max_steps=job.max_steps,
        global_batch_size=job.global_batch_size,
        checkpoint_every_steps=job.checkpoint_every_steps,
        checkpoint_every_seconds=job.checkpoint_every_seconds,
        collective_timeout_s=job.collective_timeout_s,
        worker_cpu=config.worker_requests[0],
        worker_memory=config.worker_requests[1],
        # One pod per node with all its GPUs; torchrun starts a process per GPU.
        gpus_per_worker=config.gpus_per_node,
        hpa_cpu_utilization=job.hpa_cpu_utilization,
        run_id=job.run_id,
        active_deadline_s=job.active_deadline_s,
        rendezvous=job.rendezvous,
        termination_grace_s=job.termination_grace_s,
        node_selector=(gpu_generation_selector if fallback else gpu_pool_selector)(gpu_pool),
        prefer_spot=fallback,
        nccl_ib_env=config.nccl_ib_env,
        task=config.task,
        precision=job.precision,
        parallelism=job.parallelism,
        program=WorkerProgram(job.launcher, job.script, config.training.flags, config.data.prefix),
    )


def job_name(config: LabConfig) -> str:
    """The PyTorchJob's name; also the run name its checkpoints are kept under."""
    return f"{config.name_prefix}-train"
