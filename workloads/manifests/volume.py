"""Blob containers as volumes: a static Blob CSI PersistentVolume and the claim bound to it.

The volume authenticates with the kubelet's managed identity (``AzureStorageAuthType: MSI``),
so no storage account key is ever stored in the cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BLOB_CSI_DRIVER = "blob.csi.azure.com"

# The dataset never changes during a run: keep blobfuse2's caches, and mount it read-only
# so a worker cannot damage the data every other worker reads.
DATASET_MOUNT_OPTIONS: tuple[str, ...] = ("-o allow_other", "-o ro")

# The Blob CSI driver reserves '#' and '/' inside volume handles for its own ids.
_HANDLE_FORBIDDEN = re.compile(r"[#/]")


@dataclass(frozen=True)
class BlobVolumeSpec:
    """One Blob container exposed as a PV and its PVC."""

    name: str
    """Name of the PV (cluster-wide) and of the PVC (in ``namespace``)."""
    namespace: str
    storage_account: str
    resource_group: str
    container: str
    kubelet_client_id: str
    """Client id of the kubelet identity (it holds Storage Blob Data Contributor)."""
    stack: str
    """Pulumi stack; keeps the volume handle unique if stacks share a cluster."""
    mount_options: tuple[str, ...] = DATASET_MOUNT_OPTIONS
    capacity: str = "100Gi"
    """Required by the API; Blob Storage does not enforce it."""

    @property
    def volume_handle(self) -> str:
        """The CSI volume id: unique per container in the cluster."""
        return f"{self.storage_account}_{self.container}_{self.stack}"

    def validate(self) -> None:
        """Raise ValueError naming the field that is empty or unusable."""
        for name in ("storage_account", "resource_group", "container", "kubelet_client_id"):
            if not getattr(self, name):
                raise ValueError(f"blob volume {self.name}: {name} must not be empty")
        if _HANDLE_FORBIDDEN.search(self.volume_handle):
            raise ValueError(
                f"blob volume {self.name}: volume handle {self.volume_handle!r} must not "
                "contain '#' or '/' (reserved by the Blob CSI driver)"
            )


def blob_persistent_volume(spec: BlobVolumeSpec) -> dict[str, Any]:
    """A static PV for an existing Blob container, mounted with blobfuse2."""
    spec.validate()
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": spec.name,
            "annotations": {"pv.kubernetes.io/provisioned-by": BLOB_CSI_DRIVER},
        },
        "spec": {
            "capacity": {"storage": spec.capacity},
            "accessModes": ["ReadWriteMany"],
            # Deleting the claim or the stack must never delete checkpoints or data.
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "mountOptions": list(spec.mount_options),
            "csi": {
                "driver": BLOB_CSI_DRIVER,
                "volumeHandle": spec.volume_handle,
                "volumeAttributes": {
                    "protocol": "fuse2",
                    "storageAccount": spec.storage_account,
                    "resourceGroup": spec.resource_group,
                    "containerName": spec.container,
                    "AzureStorageAuthType": "MSI",
                    "AzureStorageIdentityClientID": spec.kubelet_client_id,
                },
            },
        },
    }


def blob_volume_claim(spec: BlobVolumeSpec) -> dict[str, Any]:
    """The PVC bound to exactly that PV (by name, with no storage class to provision from)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": spec.name, "namespace": spec.namespace},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            # "" (not absent): the default StorageClass must not provision a new disk.
            "storageClassName": "",
            "volumeName": spec.name,
            "resources": {"requests": {"storage": spec.capacity}},
        },
    }
