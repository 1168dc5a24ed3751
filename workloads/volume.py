"""The dataset's read-only Blob CSI volume: the static PV and the PVC bound to it by name."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.volume import (
    DatasetVolumeSpec,
    dataset_persistent_volume,
    dataset_volume_claim,
    dataset_volume_name,
)
from workloads.ordering import child_options


@dataclass
class DatasetVolumeArgs:
    """Inputs of ``DatasetVolume``."""

    namespace: str
    """Namespace of the claim (the PV is cluster-wide and named after it)."""
    storage_account: pulumi.Input[str]
    """The lab's storage account."""
    resource_group: pulumi.Input[str]
    """The storage account's resource group."""
    container: pulumi.Input[str]
    """The ``data`` container."""
    training_client_id: pulumi.Input[str]
    """Client id of the training identity, whose token the mount signs in with."""


class DatasetVolume(pulumi.ComponentResource):
    """The ``data`` container as a ReadOnlyMany PV, keyless, and its claim."""

    claim_name: pulumi.Output[str]
    volume_name: pulumi.Output[str]

    def __init__(
        self, name: str, args: DatasetVolumeArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:DatasetVolume", name, None, opts)
        spec = pulumi.Output.all(
            args.storage_account, args.resource_group, args.container, args.training_client_id
        ).apply(
            lambda values: DatasetVolumeSpec(
                name=dataset_volume_name(args.namespace),
                namespace=args.namespace,
                storage_account=values[0],
                resource_group=values[1],
                container=values[2],
                client_id=values[3],
            )
        )
        pv = spec.apply(dataset_persistent_volume)
        volume = k8s.core.v1.PersistentVolume(
            f"{name}-pv",
            metadata=pv["metadata"],
            spec=pv["spec"],
            opts=child_options(self, opts),
        )
        pvc = spec.apply(dataset_volume_claim)
        claim = k8s.core.v1.PersistentVolumeClaim(
            f"{name}-pvc",
            metadata=pvc["metadata"],
            spec=pvc["spec"],
            opts=child_options(self, opts, depends_on=[volume]),
        )
        self.claim_name = claim.metadata.name
        self.volume_name = volume.metadata.name
        self.register_outputs({"claim_name": self.claim_name, "volume_name": self.volume_name})
