"""The dataset's Blob CSI volume: a static, read-only PV for the ``data`` container and its PVC.

Keyless: blobfuse2 signs in with the mounting pod's own workload identity token. The PV names
the training identity's ``clientID`` and ``mountWithWorkloadIdentityToken: "true"`` (a string,
parsed with ``strconv.ParseBool``), and the driver then hands blobfuse2 the pod's token and
returns before it would fetch the account key (kubernetes-sigs/blob-csi-driver
``pkg/blob/blob.go`` ``GetAuthEnv``; with ``clientID`` alone it calls
``GetStorageAccesskeyFromServiceAccountToken``, which needs shared keys, off on our account).
So no ``AzureStorageAuthType``, secret, key or ``nodeStageSecretRef``. The token comes from the
pod's ServiceAccount (the driver's ``CSIDriver.tokenRequests``), so only pods whose account
the training identity trusts can mount it; the driver mounts per pod, in ``NodePublishVolume``
(``pkg/blob/nodeserver.go``: a volume with ``clientID`` and a token skips ``NodeStageVolume``).

Read-only comes from the access mode alone on this path: ``ReadOnlyMany`` makes the driver add
``-o ro`` to blobfuse2 (``isReadOnlyFromCapability`` in ``pkg/blob``); ``readOnly`` on the
pod's mount only makes the bind mount read-only. Both are set. Pure: no pulumi import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from catalog.blob_csi import DRIVER

READ_ONLY_MANY = "ReadOnlyMany"
# The workers run as UID 10001; blobfuse2 runs as root, and FUSE shows a mount to its own user
# only unless it is mounted with allow_other.
DATASET_MOUNT_OPTIONS: tuple[str, ...] = ("-o allow_other",)
# The driver reserves '#' and '/' inside volume handles for its own ids.
_HANDLE_FORBIDDEN = re.compile(r"[#/]")


@dataclass(frozen=True)
class DatasetVolumeSpec:
    """The ``data`` container as a PV (cluster-wide) and a PVC (in ``namespace``)."""

    name: str
    """Name of the PV and of the PVC bound to it."""
    namespace: str
    storage_account: str
    resource_group: str
    """The storage account's resource group (the driver's default is the node resource group)."""
    container: str
    client_id: str
    """Client id of the training identity: blobfuse2 signs in as it with the pod's token."""
    capacity: str = "10Gi"
    """Required by the API; Blob Storage does not enforce it."""

    @property
    def volume_handle(self) -> str:
        """The CSI volume id: unique per container and namespace in the cluster."""
        return f"{self.storage_account}_{self.container}_{self.namespace}"

    def validate(self) -> None:
        """Raise ValueError naming the field that is empty or unusable."""
        for name in ("storage_account", "resource_group", "container", "client_id"):
            if not getattr(self, name):
                raise ValueError(f"dataset volume {self.name}: {name} must not be empty")
        if _HANDLE_FORBIDDEN.search(self.volume_handle):
            raise ValueError(
                f"dataset volume {self.name}: volume handle {self.volume_handle!r} must not "
                "contain '#' or '/' (the Blob CSI driver reserves them)"
            )


def dataset_persistent_volume(spec: DatasetVolumeSpec) -> dict[str, Any]:
    """The static PV: read-only, mounted with the pod's workload identity token."""
    spec.validate()
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": spec.name,
            "annotations": {"pv.kubernetes.io/provisioned-by": DRIVER},
        },
        "spec": {
            "capacity": {"storage": spec.capacity},
            "accessModes": [READ_ONLY_MANY],
            # Deleting the claim or the stack never deletes the data.
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "mountOptions": list(DATASET_MOUNT_OPTIONS),
            "csi": {
                "driver": DRIVER,
                "volumeHandle": spec.volume_handle,
                "readOnly": True,
                "volumeAttributes": {
                    "protocol": "fuse2",
                    "storageAccount": spec.storage_account,
                    "resourceGroup": spec.resource_group,
                    "containerName": spec.container,
                    "clientID": spec.client_id,
                    "mountWithWorkloadIdentityToken": "true",
                },
            },
        },
    }


def dataset_volume_claim(spec: DatasetVolumeSpec) -> dict[str, Any]:
    """The PVC bound to exactly that PV: by name, with no storage class to provision from."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": spec.name, "namespace": spec.namespace},
        "spec": {
            "accessModes": [READ_ONLY_MANY],
            # "" (not absent): the default StorageClass must not provision a new volume.
            "storageClassName": "",
            "volumeName": spec.name,
            "resources": {"requests": {"storage": spec.capacity}},
        },
    }


def dataset_volume_name(namespace: str) -> str:
    """The PV's (cluster-wide) and the PVC's name: one per lab namespace."""
    return f"{namespace}-dataset"
