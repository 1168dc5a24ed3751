"""A worker whose volume cannot mount, as one line with the fix.

Such a pod stays in ``ContainerCreating``, and only its ``FailedMount`` events say why. The kubelet
repeats the event on every retry, so each pod's cause is said once. The causes the dataset's
Blob CSI volume (``workloads/manifests/volume.py``) meets, and how they read:

- **Refused by Blob Storage.** blobfuse2 checks a new mount by listing the container
  (Azure/azure-storage-fuse ``component/azstorage/azstorage.go``, ``configureAndTest``), and
  reports a refusal as "failed to authenticate credentials for azstorage" (its TSG, "Common Mount
  Problems"); newer builds add the service's code, ``AuthorizationPermissionMismatch`` for a 403.
  On this keyless volume that means the training identity lacks Storage Blob Data Reader on the
  ``data`` container, or the role is not applied yet: Azure RBAC can take minutes.
- **No driver.** The kubelet's CSI client says "driver name blob.csi.azure.com not found in the
  list of registered CSI drivers" (kubernetes ``pkg/volume/csi/csi_client.go``,
  ``newCsiDriverClient``): AKS's managed Blob CSI driver is off
  (``storageProfile.blobCSIDriver.enabled``).
- **Anything else** points at ``kubectl describe pod``, unless a cause above was already said for
  that pod (the kubelet's later "timed out waiting for the condition" adds nothing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from catalog.blob_csi import DRIVER
from lab.report.run_logs import ClusterEvent
from workloads.manifests.volume import dataset_volume_name

REFUSED, NO_DRIVER, OTHER = "refused", "no driver", "other"
_REFUSED = re.compile(
    r"AuthorizationPermissionMismatch|AuthorizationFailure|\b403\b|failed to authenticate"
)
_NO_DRIVER = re.compile(r"driver name (\S+) not found in the list of registered CSI drivers")
_VOLUME = re.compile(r'volume "([^"]+)"')
_UNMOUNTED = re.compile(r"unmounted volumes=\[([^\]]*)\]")


def mount_cause(message: str) -> str:
    """``refused``, ``no driver`` or ``other`` for a FailedMount event's message."""
    driver = _NO_DRIVER.search(message)
    if driver and driver.group(1) == DRIVER:
        return NO_DRIVER
    if _REFUSED.search(message):
        return REFUSED
    return OTHER


def _volume(message: str) -> str:
    """The volume the kubelet names: the PV's name, or the pod's volumes that wait."""
    named = _VOLUME.search(message) or _UNMOUNTED.search(message)
    return named.group(1) if named else ""


@dataclass
class MountFailures:
    """The job's FailedMount events, each pod's cause said once."""

    namespace: str
    job: str
    _said: dict[str, set[str]] = field(default_factory=dict)

    def line(self, event: ClusterEvent) -> str | None:
        """The line for ``event`` if it is a FailedMount of the job's not said before."""
        if event.reason != "FailedMount" or event.kind != "Pod":
            return None
        if not event.name.startswith(f"{self.job}-"):
            return None
        cause = mount_cause(event.message)
        said = self._said.setdefault(event.name, set())
        if cause in said or (cause == OTHER and said):
            return None
        said.add(cause)
        return f"FailedMount {event.name}: {self._what(event.message)}{self._fix(cause, event)}"

    def _what(self, message: str) -> str:
        volume = _volume(message)
        dataset = dataset_volume_name(self.namespace)
        if volume == dataset:
            return f"the dataset volume {dataset} "
        return f"volume {volume} " if volume else ""

    def _fix(self, cause: str, event: ClusterEvent) -> str:
        if cause == REFUSED:
            return (
                "was refused by Blob Storage: the training identity needs Storage Blob Data "
                "Reader on the data container (pulumi up grants it; a new role assignment can "
                "take minutes to apply, and the kubelet keeps retrying)"
            )
        if cause == NO_DRIVER:
            return (
                f"has no driver: {DRIVER} is not running on the node, so the cluster's Blob CSI "
                "driver is off; turn on storageProfile.blobCSIDriver.enabled (pulumi up sets it; "
                "by hand: az aks update --enable-blob-driver)"
            )
        said = " ".join(event.message.split())
        said = said if len(said) <= 200 else said[:199] + "…"
        return f"did not mount ({said}); see kubectl describe pod -n {self.namespace} {event.name}"
