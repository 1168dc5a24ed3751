"""The elastic PyTorchJob, created once the operator, etcd, the dataset volume and its GPU pool
exist."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from stack_config import LabConfig
from workloads.manifests.job import (
    PYTORCHJOB_API_VERSION,
    PYTORCHJOB_KIND,
    ElasticJobSpec,
    blob_url,
    elastic_job_spec,
    job_name,
    pytorchjob_manifest,
    rendezvous_id,
)
from workloads.ordering import child_options


@dataclass
class ElasticTrainingJobArgs:
    """Inputs of ``ElasticTrainingJob``."""

    config: LabConfig
    """Validated stack config: replicas, restarts, checkpointing, resources."""
    image: pulumi.Input[str]
    """Training image with its content-hash tag."""
    rdzv_host: pulumi.Input[str]
    """DNS name of the etcd client Service."""
    priority_class: pulumi.Input[str]
    """The preemptible training PriorityClass."""
    blob_endpoint: pulumi.Input[str]
    """``https://<account>.blob.core.windows.net/``: checkpoints go through the Blob API, with
    the workers' own identity."""
    data_claim: pulumi.Input[str]
    """The dataset volume's claim, mounted read-only."""
    checkpoints_container: pulumi.Input[str]
    gpu_pool_name: pulumi.Input[str]
    """The GPU pool generation the workers select; an Output of the pool, so a new pool comes
    first and the job follows it."""


class ElasticTrainingJob(pulumi.ComponentResource):
    """A kubeflow.org/v1 PyTorchJob with an etcd elasticPolicy, Worker replicas only."""

    job_name: pulumi.Output[str]
    rdzv_id: pulumi.Output[str]
    checkpoint_uri: pulumi.Output[str]

    def __init__(
        self, name: str, args: ElasticTrainingJobArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:ElasticTrainingJob", name, None, opts)
        cfg = args.config
        spec = pulumi.Output.all(
            args.image,
            args.rdzv_host,
            args.priority_class,
            args.blob_endpoint,
            args.data_claim,
            args.checkpoints_container,
            args.gpu_pool_name,
        ).apply(lambda values: _spec(cfg, *values))
        manifest = spec.apply(pytorchjob_manifest)
        job = k8s.apiextensions.CustomResource(
            f"{name}-pytorchjob",
            api_version=PYTORCHJOB_API_VERSION,
            kind=PYTORCHJOB_KIND,
            metadata=manifest["metadata"],
            spec=manifest["spec"],
            # The operator does not roll running pods when a job's spec changes, and a new
            # spec carries a new rdzvId: replace the job (same name, so delete it first).
            opts=pulumi.ResourceOptions.merge(
                child_options(self, opts),
                pulumi.ResourceOptions(replace_on_changes=["spec"], delete_before_replace=True),
            ),
        )
        self.job_name = job.metadata.apply(lambda _: job_name(cfg))
        self.rdzv_id = spec.apply(rendezvous_id)
        self.checkpoint_uri = spec.apply(lambda s: s.checkpoint_uri)
        self.register_outputs(
            {
                "job_name": self.job_name,
                "rdzv_id": self.rdzv_id,
                "checkpoint_uri": self.checkpoint_uri,
            }
        )


def _spec(cfg: LabConfig, *values: Any) -> ElasticJobSpec:
    image, rdzv_host, priority_class, endpoint, data_claim, checkpoints, gpu_pool = values
    return elastic_job_spec(
        cfg,
        image=image,
        rdzv_host=rdzv_host,
        priority_class=priority_class,
        data_claim=data_claim,
        checkpoint_uri=blob_url(endpoint, checkpoints, job_name(cfg)),
        gpu_pool=gpu_pool,
    )
