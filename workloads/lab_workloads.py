"""``LabWorkloads``: every Kubernetes object of the lab, through one provider.

It takes the cluster's kubeconfig and the Azure outputs it needs and creates,
through one Kubernetes provider (server-side apply):

- the namespace and the training ServiceAccount (workload identity),
- PriorityClasses: preemptible training below the rendezvous,
- etcd (the rendezvous) on the system pool,
- the NVIDIA device plugin on the GPU pools, and the nodes' agent that turns Azure's eviction
  notice into the workers' SIGTERM,
- with the on-demand fallback on, the cluster autoscaler's priorities (Spot first),
- the Kubeflow training operator v1.9.4,
- with InfiniBand (``rdma``), NVIDIA's Network Operator and its RDMA device plugin,
- the dataset's read-only Blob CSI volume and the Job that stages the dataset,
- the elastic PyTorchJob, and the record of what its run started with.

The provider, and so every object, waits for the deployer's access to the cluster and for the
node pools; ``pulumi destroy`` therefore deletes every object before the pools, the role and
the cluster. The objects themselves come from the pure builders in ``workloads.manifests``; a
concept of several objects has a component of its own, one object is created here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
from pulumi_kubernetes.kustomize.v2 import Directory

from stack_config import LabConfig
from workloads.data_staging import DataStaging, DataStagingArgs
from workloads.etcd import Rendezvous, RendezvousArgs
from workloads.job import ElasticTrainingJob, ElasticTrainingJobArgs
from workloads.manifests.autoscaler import priority_expander_configmap
from workloads.manifests.data_staging import DataStagingSpec
from workloads.manifests.device_plugin import DevicePluginSpec, device_plugin_daemonset
from workloads.manifests.etcd import EtcdSpec
from workloads.manifests.job import job_name
from workloads.manifests.node_agent import NodeAgentSpec
from workloads.manifests.operator import (
    OPERATOR_NAMESPACE,
    OPERATOR_POD_LABELS,
    training_operator_source,
)
from workloads.manifests.priority import lab_priority_classes, priority_class_manifests
from workloads.manifests.scheduling import any_gpu_pool
from workloads.manifests.watch import watch_commands
from workloads.namespace import LabNamespace, LabNamespaceArgs
from workloads.network_operator import NetworkOperator, NetworkOperatorArgs
from workloads.node_agent import NodeAgent, NodeAgentArgs
from workloads.volume import DatasetVolume, DatasetVolumeArgs

__all__ = ["LabWorkloads", "LabWorkloadsArgs"]


@dataclass
class LabWorkloadsArgs:
    """Inputs of ``LabWorkloads``: the stack config plus what the Azure side created."""

    config: LabConfig
    """Validated stack config."""
    kubeconfig: pulumi.Input[str]
    """Kubeconfig of the AKS cluster (secret)."""
    image: pulumi.Input[str]
    """Full training image reference, content-hash tag."""
    stager_image: pulumi.Input[str]
    """The data-staging Job's image (no CUDA), content-hash tag."""
    storage_account: pulumi.Input[str]
    """The lab's storage account (the dataset volume mounts its ``data`` container)."""
    storage_resource_group: pulumi.Input[str]
    """The storage account's resource group."""
    data_container: pulumi.Input[str]
    """Blob container holding the dataset."""
    checkpoints_container: pulumi.Input[str]
    """Blob container holding the checkpoints."""
    blob_endpoint: pulumi.Input[str]
    """``https://<account>.blob.core.windows.net/``."""
    training_client_id: pulumi.Input[str]
    """Client id of the training identity: the training ServiceAccount is bound to it."""
    stager_client_id: pulumi.Input[str]
    """Client id of the stager identity: the data-staging Job's ServiceAccount is bound to it."""
    gpu_pool_name: pulumi.Input[str]
    """The GPU Spot pool's AgentPool name: the workers select that generation, and the job
    follows a new pool (it depends on it)."""
    cluster_identifier: str
    """A plain string naming the cluster (its resource group and name), known at preview."""
    access: list[pulumi.Resource] = field(default_factory=list)
    """What must exist before any object: the wait for the deployer's cluster-admin role and
    the node pools. On destroy every object goes before them."""


class LabWorkloads(pulumi.ComponentResource):
    """All Kubernetes objects of the lab, applied through one provider."""

    namespace: pulumi.Output[str]
    job_name: pulumi.Output[str]
    rdzv_id: pulumi.Output[str]
    """The job's rendezvous id: changes with a new image, spec or runId."""
    checkpoint_uri: pulumi.Output[str]
    """Where the job's run keeps its checkpoints (Blob URL)."""
    watch_commands: pulumi.Output[dict[str, str]]

    def __init__(
        self, name: str, args: LabWorkloadsArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:LabWorkloads", name, None, opts)
        cfg = args.config
        provider = self._kubernetes(name, args)
        cluster = pulumi.ResourceOptions(parent=self, providers=[provider])
        namespace = LabNamespace(
            f"{name}-namespace",
            LabNamespaceArgs(
                name=cfg.namespace,
                service_account=cfg.service_account,
                training_client_id=args.training_client_id,
                allow_ipc_lock=cfg.infiniband,
            ),
            opts=cluster,
        )
        training_class, rendezvous_class = lab_priority_classes(cfg.name_prefix)
        training_priority, rendezvous_priority = self._priority_classes(
            name, priority_class_manifests(training_class, rendezvous_class), cluster
        )
        # CRDs, webhook and controller of the PyTorchJob API, built by the provider and applied
        # server-side: the PyTorchJob CRD is larger than client-side apply's annotation.
        operator = Directory(
            f"{name}-operator-kustomize",
            directory=training_operator_source(),
            opts=self._folded(f"{name}-operator", "TrainingOperator", cluster),
        )
        gpu_side = self._gpu_side(name, args, cluster)
        in_namespace = pulumi.ResourceOptions.merge(
            cluster,
            pulumi.ResourceOptions(depends_on=[namespace, training_priority, rendezvous_priority]),
        )
        etcd_spec = EtcdSpec(
            namespace=cfg.namespace,
            priority_class=rendezvous_class.name,
            replicas=cfg.etcd_members,
            operator_namespace=OPERATOR_NAMESPACE,
            operator_pod_labels=dict(OPERATOR_POD_LABELS),
        )
        rendezvous = Rendezvous(f"{name}-etcd", RendezvousArgs(spec=etcd_spec), opts=in_namespace)
        self._node_agent(name, args, rendezvous_class.name, in_namespace)
        dataset = DatasetVolume(
            f"{name}-dataset",
            DatasetVolumeArgs(
                namespace=cfg.namespace,
                storage_account=args.storage_account,
                resource_group=args.storage_resource_group,
                container=args.data_container,
                training_client_id=args.training_client_id,
            ),
            opts=in_namespace,
        )
        # The CRD and its webhook must exist, etcd must answer and the data must be staged,
        # before the job: GPU nodes start only for a job that can train.
        before_job: list[pulumi.Resource] = [operator, rendezvous, dataset, *gpu_side]
        if cfg.infiniband:  # the workers ask for its rdma/shared_ib
            before_job.append(
                NetworkOperator(
                    f"{name}-network-operator",
                    NetworkOperatorArgs(vm_size=cfg.gpu_pool.vm_size),
                    opts=cluster,
                )
            )
        if cfg.data.staged:
            before_job.append(self._staging(name, args, in_namespace).job)
        job_opts = pulumi.ResourceOptions.merge(
            in_namespace, pulumi.ResourceOptions(depends_on=before_job)
        )
        job = self._job(name, args, rendezvous, training_priority, dataset, job_opts)
        self.namespace = namespace.name
        self.job_name = job.job_name
        self.rdzv_id = job.rdzv_id
        self.checkpoint_uri = job.checkpoint_uri
        self.watch_commands = pulumi.Output.from_input(
            watch_commands(cfg.namespace, job_name(cfg), cfg.job.max_replicas, cfg.fallback.enabled)
        )
        self.register_outputs(
            {
                "namespace": self.namespace,
                "job_name": self.job_name,
                "rdzv_id": self.rdzv_id,
                "checkpoint_uri": self.checkpoint_uri,
                "watch_commands": self.watch_commands,
            }
        )

    def _kubernetes(self, name: str, args: LabWorkloadsArgs) -> k8s.Provider:
        """The one Kubernetes provider: every object waits for what ``args.access`` names."""
        return k8s.Provider(
            f"{name}-kubernetes",
            kubeconfig=args.kubeconfig,
            # While the cluster is being updated its kubeconfig is unknown at preview, and without
            # an identifier the provider, and so every object under it, is planned for
            # replacement. With one, the provider is replaced only when this string changes
            # (pulumi-kubernetes Provider docs, `clusterIdentifier`).
            cluster_identifier=args.cluster_identifier,
            # The PyTorchJob CRD is too large for client-side apply's annotation.
            enable_server_side_apply=True,
            # `pulumi destroy` finishes when the cluster is gone, stopped or unreachable (an
            # expired sign-in): its objects are dropped from the state instead of failing to
            # delete ("configured Kubernetes cluster is unreachable"; pulumi-kubernetes
            # provider.go, Delete and Read). A refresh while unreachable drops them too; the next
            # `up` then takes the objects that are still there over instead of failing with
            # AlreadyExists (provider.go, upsertExistingObjects with server-side apply).
            delete_unreachable=True,
            upsert_existing_objects=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=args.access),
        )

    def _folded(
        self, component_name: str, component_type: str, opts: pulumi.ResourceOptions
    ) -> pulumi.ResourceOptions:
        """Options for an object that a component of its own held once: the alias names its
        old parent, so an ``up`` on a stack that holds it keeps it instead of replacing it
        (tests/workloads/test_workloads_urns.py pins every URN)."""
        old_parent = pulumi.resource.create_urn(
            component_name, f"spot-lab:workloads:{component_type}", parent=self
        )
        return pulumi.ResourceOptions.merge(
            opts, pulumi.ResourceOptions(aliases=[pulumi.Alias(parent=old_parent)])
        )

    def _priority_classes(
        self,
        name: str,
        manifests: tuple[dict[str, Any], dict[str, Any]],
        opts: pulumi.ResourceOptions,
    ) -> tuple[k8s.scheduling.v1.PriorityClass, k8s.scheduling.v1.PriorityClass]:
        """The workers' class and, above it, etcd's (cluster-wide)."""
        training, rendezvous = (
            k8s.scheduling.v1.PriorityClass(
                f"{name}-priority-{role}",
                metadata=obj["metadata"],
                value=obj["value"],
                preemption_policy=obj["preemptionPolicy"],
                global_default=obj["globalDefault"],
                description=obj["description"],
                opts=self._folded(f"{name}-priority", "PriorityClasses", opts),
            )
            for role, obj in zip(("training", "rendezvous"), manifests, strict=True)
        )
        return training, rendezvous

    def _gpu_side(
        self, name: str, args: LabWorkloadsArgs, opts: pulumi.ResourceOptions
    ) -> list[pulumi.Resource]:
        """The device plugin on every GPU node and, with the on-demand fallback, the
        autoscaler's priorities; returns what the job must wait for (the expander scales no
        pool while its ConfigMap is missing, so it comes before the job's pending pods)."""
        fallback = args.config.fallback.enabled
        # AKS installs only the driver: the plugin advertises ``nvidia.com/gpu``.
        plugin = device_plugin_daemonset(
            DevicePluginSpec(node_selector={}, affinity=any_gpu_pool())
            if fallback
            else DevicePluginSpec()
        )
        k8s.apps.v1.DaemonSet(
            f"{name}-device-plugin-daemonset",
            metadata=plugin["metadata"],
            spec=plugin["spec"],
            opts=self._folded(f"{name}-device-plugin", "NvidiaDevicePlugin", opts),
        )
        if not fallback:
            return []
        # AKS's autoscaler reads it when its profile says ``expander: priority``.
        priorities = priority_expander_configmap()
        return [
            k8s.core.v1.ConfigMap(
                f"{name}-autoscaler-priorities-configmap",
                metadata=priorities["metadata"],
                data=priorities["data"],
                opts=self._folded(f"{name}-autoscaler-priorities", "AutoscalerPriorities", opts),
            )
        ]

    def _node_agent(
        self, name: str, args: LabWorkloadsArgs, priority: str, opts: pulumi.ResourceOptions
    ) -> NodeAgent:
        """The agent on every GPU node (both pools with the fallback, as the device plugin)."""
        cfg = args.config
        placement: dict[str, Any] = (
            {"node_selector": {}, "affinity": any_gpu_pool()} if cfg.fallback.enabled else {}
        )
        spec = pulumi.Output.from_input(args.image).apply(
            lambda image: NodeAgentSpec(
                namespace=cfg.namespace, image=image, priority_class=priority, **placement
            )
        )
        return NodeAgent(
            f"{name}-node-agent", NodeAgentArgs(spec=spec, namespace=cfg.namespace), opts=opts
        )

    def _staging(
        self, name: str, args: LabWorkloadsArgs, opts: pulumi.ResourceOptions
    ) -> DataStaging:
        """The Job that downloads the dataset into the data container."""
        cfg = args.config
        spec = pulumi.Output.all(args.stager_image, args.blob_endpoint, args.data_container).apply(
            lambda values: DataStagingSpec(
                job_prefix=job_name(cfg),
                namespace=cfg.namespace,
                image=values[0],
                service_account=cfg.stager_service_account,
                source_url=cfg.data_source.url,
                checksum=cfg.data_source.checksum,
                container_uri=f"{values[1].rstrip('/')}/{values[2]}",
                data_format=cfg.data_source.format,
            )
        )
        return DataStaging(
            f"{name}-data-staging",
            DataStagingArgs(
                spec=spec,
                stager_client_id=args.stager_client_id,
                namespace=cfg.namespace,
                service_account=cfg.stager_service_account,
            ),
            opts=opts,
        )

    def _job(
        self,
        name: str,
        args: LabWorkloadsArgs,
        rendezvous: Rendezvous,
        priority: k8s.scheduling.v1.PriorityClass,
        dataset: DatasetVolume,
        opts: pulumi.ResourceOptions,
    ) -> ElasticTrainingJob:
        """The elastic PyTorchJob: data through the read-only volume, checkpoints through the
        Blob API, workers on the current GPU pool generation."""
        return ElasticTrainingJob(
            f"{name}-job",
            ElasticTrainingJobArgs(
                config=args.config,
                image=args.image,
                rdzv_host=rendezvous.host,
                etcd_members=rendezvous.members,
                priority_class=priority.metadata.name,
                blob_endpoint=args.blob_endpoint,
                data_claim=dataset.claim_name,
                checkpoints_container=args.checkpoints_container,
                gpu_pool_name=args.gpu_pool_name,
            ),
            opts=opts,
        )
