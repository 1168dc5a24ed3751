"""A Blob container as a ReadWriteMany volume: a static Blob CSI PV and its claim."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.volume import (
    DATASET_MOUNT_OPTIONS,
    BlobVolumeSpec,
    blob_persistent_volume,
    blob_volume_claim,
)
from workloads.ordering import child_options


@dataclass
class BlobVolumeArgs:
    """Inputs of ``BlobVolume``."""

    name: str
    """Name of the PV and the PVC."""
    namespace: str
    """Namespace of the PVC."""
    stack: str
    """Pulumi stack (part of the cluster-unique volume handle)."""
    storage_account: pulumi.Input[str]
    resource_group: pulumi.Input[str]
    """Resource group of the storage account."""
    container: pulumi.Input[str]
    kubelet_client_id: pulumi.Input[str]
    """The kubelet identity mounts the container (no account keys)."""
    mount_options: tuple[str, ...] = DATASET_MOUNT_OPTIONS
    """blobfuse2 options; the default mounts read-only with the caches on."""


class BlobVolume(pulumi.ComponentResource):
    """A static PersistentVolume for an existing Blob container, and the PVC bound to it."""

    claim_name: pulumi.Output[str]
    volume_name: pulumi.Output[str]

    def __init__(
        self, name: str, args: BlobVolumeArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:BlobVolume", name, None, opts)
        spec = pulumi.Output.all(
            args.storage_account, args.resource_group, args.container, args.kubelet_client_id
        ).apply(
            lambda values: BlobVolumeSpec(
                name=args.name,
                namespace=args.namespace,
                stack=args.stack,
                storage_account=values[0],
                resource_group=values[1],
                container=values[2],
                kubelet_client_id=values[3],
                mount_options=args.mount_options,
            )
        )
        pv = spec.apply(blob_persistent_volume)
        volume = k8s.core.v1.PersistentVolume(
            f"{name}-pv",
            metadata=pv["metadata"],
            spec=pv["spec"],
            opts=child_options(self, opts),
        )
        pvc = spec.apply(blob_volume_claim)
        claim = k8s.core.v1.PersistentVolumeClaim(
            f"{name}-pvc",
            metadata=pvc["metadata"],
            spec=pvc["spec"],
            opts=child_options(self, opts, depends_on=[volume]),
        )
        self.claim_name = claim.metadata.name
        self.volume_name = volume.metadata.name
        self.register_outputs({"claim_name": self.claim_name, "volume_name": self.volume_name})
