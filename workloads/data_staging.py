"""The data-staging Job and its ServiceAccount: ``pulumi up`` waits for the data before the job.

pulumi-kubernetes waits for a batch/v1 Job to report ``Complete`` (and fails on ``Failed``;
see the Job resource's docs), so anything that depends on this component is created only once
the data is in the container. A failed staging stops ``pulumi up`` before any GPU is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.data_staging import (
    DEADLINE_S,
    DataStagingSpec,
    staging_job_manifest,
    staging_job_name,
)
from workloads.manifests.namespace import training_service_account
from workloads.ordering import child_options


@dataclass
class DataStagingArgs:
    """Inputs of ``DataStaging``."""

    spec: pulumi.Input[DataStagingSpec]
    """The Job's spec; an Output because the image and the container URL are."""
    stager_client_id: pulumi.Input[str]
    """Client id of the stager identity, the only one that may write ``data``."""
    namespace: str
    service_account: str


class DataStaging(pulumi.ComponentResource):
    """The stager's ServiceAccount and the Job that stages the dataset."""

    job_name: pulumi.Output[str]

    def __init__(
        self, name: str, args: DataStagingArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:DataStaging", name, None, opts)
        account = pulumi.Output.from_input(args.stager_client_id).apply(
            lambda client_id: training_service_account(
                args.service_account, args.namespace, client_id
            )
        )
        service_account = k8s.core.v1.ServiceAccount(
            f"{name}-service-account",
            metadata=account["metadata"],
            opts=child_options(self, opts),
        )
        manifest = pulumi.Output.from_input(args.spec).apply(staging_job_manifest)
        job = k8s.batch.v1.Job(
            f"{name}-job",
            metadata=manifest["metadata"],
            spec=manifest["spec"],
            opts=pulumi.ResourceOptions.merge(
                child_options(self, opts, depends_on=[service_account]),
                # The default wait is 10 minutes; a slow mirror may need more. The Job's own
                # activeDeadlineSeconds ends it at the same bound.
                pulumi.ResourceOptions(
                    custom_timeouts=pulumi.CustomTimeouts(create=f"{DEADLINE_S}s")
                ),
            ),
        )
        self.job_name = pulumi.Output.from_input(args.spec).apply(staging_job_name)
        self.job = job
        self.register_outputs({"job_name": self.job_name})
