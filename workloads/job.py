"""The elastic PyTorchJob, created once the operator, etcd, the dataset volume and its GPU pool
exist, with the record of what its run started with.

Each ``runId`` has a record (a ConfigMap, ``run_record_manifest``) holding the run's identity
as ``up`` first saw it. The record keeps those first values (``ignoreChanges`` on its data:
the engine puts the old inputs back, pulumi/pulumi #2657), so at every later ``up``, preview
included, its output is what the run started with, read from Pulumi's own state. The job's
spec waits for that comparison (``identity_problem``): a setting that changes what the run's
checkpoints hold is refused before the job is touched, unless ``runId`` changed, which is a new
record (a new name) and a new run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from stack_config import ConfigError, LabConfig
from stack_config.train_args import identity_problem
from workloads.manifests.job import (
    PYTORCHJOB_API_VERSION,
    PYTORCHJOB_KIND,
    ElasticJobSpec,
    elastic_job_spec,
    job_name,
    pytorchjob_manifest,
    rendezvous_id,
)
from workloads.manifests.run import blob_url, checkpoint_path, run_record_manifest
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
    etcd_members: tuple[str, ...]
    """Each etcd member's ``host:port``, for the agents to move on to."""
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
        record = run_record_manifest(cfg)
        run_record = k8s.core.v1.ConfigMap(
            f"{name}-run-{cfg.job.run_id}",
            metadata=record["metadata"],
            data=record["data"],
            opts=pulumi.ResourceOptions.merge(
                child_options(self, opts), pulumi.ResourceOptions(ignore_changes=["data"])
            ),
        )
        spec = pulumi.Output.all(
            run_record.data.apply(lambda recorded: _checked(cfg, recorded)),
            args.image,
            args.rdzv_host,
            args.priority_class,
            args.blob_endpoint,
            args.data_claim,
            args.checkpoints_container,
            args.gpu_pool_name,
        ).apply(lambda values: _spec(cfg, args.etcd_members, *values[1:]))
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


class ConfigRefused(pulumi.RunError):
    """A stack config ``pulumi up`` refuses: a bad value, or settings that change what the
    recorded run's checkpoints hold; ``problems`` has one line each.

    A ``RunError``: Pulumi prints the message alone, not a traceback (the SDK's
    ``run_in_stack`` logs a ``RunError`` as its text), and raised in an ``apply`` it is not
    wrapped into the input being serialized ("While processing input"), as a ValueError is.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(str(ConfigError(self.problems)))


def _checked(cfg: LabConfig, recorded: dict[str, str] | None) -> bool:
    """Refuse the settings when they change what the recorded run's checkpoints hold."""
    problem = identity_problem(cfg, recorded or {})
    if problem is not None:
        raise ConfigRefused([problem])
    return True


def _spec(cfg: LabConfig, etcd_members: tuple[str, ...], *values: Any) -> ElasticJobSpec:
    image, rdzv_host, priority_class, endpoint, data_claim, checkpoints, gpu_pool = values
    return elastic_job_spec(
        cfg,
        image=image,
        rdzv_host=rdzv_host,
        etcd_members=etcd_members,
        priority_class=priority_class,
        data_claim=data_claim,
        checkpoint_uri=blob_url(endpoint, checkpoints, checkpoint_path(cfg)),
        gpu_pool=gpu_pool,
    )
