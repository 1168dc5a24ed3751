"""What the Blob CSI driver does, per the version AKS runs: the facts the lab's choices rest on.

The dataset volume mounts with the pod's own workload identity token
(``mountWithWorkloadIdentityToken: "true"`` and the identity's ``clientID``), which needs no
account key (kubernetes-sigs/blob-csi-driver ``pkg/blob/blob.go``, ``GetAuthEnv``: that branch
returns before ``GetStorageAccesskeyFromServiceAccountToken``; in v1.25.6, v1.26.x and v1.27.x).
Whether the token in a mount is ever refreshed depends on the driver's ``CSIDriver`` object
(``deploy/csi-blob-driver.yaml``): before v1.27 it has ``tokenRequests`` without
``requiresRepublish``, so kubelet hands the token over once, at mount time, and the driver's
docs say such a mount stops working once the token expires (about 24 h,
``docs/workload-identity-static-pv-mount.md`` at v1.26); from v1.27.0 it sets
``requiresRepublish: true`` and ``expirationSeconds: 3600``, and the driver rewrites the token
file that blobfuse2 re-reads. Which driver each AKS minor version runs is from the Azure/AKS
CHANGELOG. The workers copy the dataset from the mount when they start, which needs a fresh
token only once per pod (each pod mounts afresh), so it works on every version listed here.

Pure: imports nothing of ours. ``lab preflight`` and the docs read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DRIVER = "blob.csi.azure.com"
"""The CSI driver name AKS's managed Blob CSI driver registers."""


@dataclass(frozen=True)
class DriverLine:
    """The Blob CSI driver release line one AKS minor version runs."""

    driver: str
    """The driver's minor line, e.g. ``v1.26``."""
    refreshes_token: bool
    """Whether a mounted workload identity token is refreshed (``requiresRepublish``)."""


# Azure/AKS CHANGELOG: 1.31 ships v1.25.x, 1.32 and 1.33 ship v1.26.x, 1.34 and later v1.27.x.
_LINES: dict[tuple[int, int], DriverLine] = {
    (1, 31): DriverLine("v1.25", refreshes_token=False),
    (1, 32): DriverLine("v1.26", refreshes_token=False),
    (1, 33): DriverLine("v1.26", refreshes_token=False),
    (1, 34): DriverLine("v1.27", refreshes_token=True),
}
FIRST_REFRESHING = (1, 34)
"""The first AKS minor version whose driver refreshes a mounted token."""
OLDEST_KNOWN = min(_LINES)
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.\d+)?$")


def aks_minor(kubernetes_version: str) -> tuple[int, int]:
    """``(1, 33)`` for "1.33" or "1.33.2"; ValueError for anything else."""
    match = _VERSION.match(kubernetes_version.strip())
    if not match:
        raise ValueError(f"not a Kubernetes version such as 1.33 or 1.33.2: {kubernetes_version!r}")
    return int(match[1]), int(match[2])


def driver_line(kubernetes_version: str) -> DriverLine | None:
    """The driver line AKS runs at this version; None for versions older than the table.

    Versions newer than the table run v1.27 or later, which refresh the token too.
    """
    minor = aks_minor(kubernetes_version)
    if minor in _LINES:
        return _LINES[minor]
    if minor > FIRST_REFRESHING:
        return DriverLine("v1.27 or later", refreshes_token=True)
    return None
