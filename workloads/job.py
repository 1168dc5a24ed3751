"""The elastic PyTorchJob, created once the operator, etcd and the volumes exist."""

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
    """``https://<account>.blob.core.windows.net/``: data and checkpoints go through the Blob
    API, with the workers' own identity."""
    data_container: pulumi.Input[str]
    checkpoints_container: pulumi.Input[str]


class ElasticTrainingJob(pulumi.ComponentResource):
    """A kubeflow.org/v1 PyTorchJob with an etcd-v2 elasticPolicy, Worker replicas only."""

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
            args.data_container,
            args.checkpoints_container,
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
    image, rdzv_host, priority_class, endpoint, data_container, checkpoints_container = values
    return elastic_job_spec(
        cfg,
        image=image,
        rdzv_host=rdzv_host,
        priority_class=priority_class,
        data_uri=blob_url(endpoint, data_container),
        checkpoint_uri=blob_url(endpoint, checkpoints_container, job_name(cfg)),
    )
