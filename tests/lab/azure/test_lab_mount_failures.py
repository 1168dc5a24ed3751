"""A FailedMount on the job's pods as one line with the fix (lab/azure/cluster/mount_failures.py).

The messages are in the forms the kubelet and the driver print: blobfuse2's refused mount check
(Azure/azure-storage-fuse ``component/azstorage/azstorage.go``, ``configureAndTest``, as
blob-csi-driver's issues quote it inside ``Mount failed with error``; newer blobfuse2 builds add
the service's code in brackets), the kubelet's CSI client without the driver (kubernetes
``pkg/volume/csi/csi_client.go``, ``newCsiDriverClient``), and the kubelet's timeout after it
(``Unable to attach or mount volumes``). ``lab watch`` and ``lab drill`` show
them end to end in tests/lab/azure/test_lab_watch.py and tests/lab/azure/test_lab_drill.py.
"""

from __future__ import annotations

import pytest

from lab.azure.cluster.mount_failures import NO_DRIVER, OTHER, REFUSED, MountFailures, mount_cause
from lab.report.run_logs import ClusterEvent
from tests.support.cluster_runs import DATASET, NO_BLOB_DRIVER, REFUSED_OLD, TIMED_OUT

REFUSED_NEW = (
    f'MountVolume.SetUp failed for volume "{DATASET}" : rpc error: code = Internal desc = Mount '
    "failed with error: rpc error: code = Unknown desc = exit status 1 Error: failed to initialize "
    "new pipeline [failed to authenticate azstorage credentials with error [BlockBlob::"
    "TestPipeline : [AuthorizationPermissionMismatch]]]"
)
OTHER_VOLUME = (
    'MountVolume.SetUp failed for volume "kube-api-access-7xk2p" : object "spot-lab"/'
    '"kube-root-ca.crt" not registered'
)


@pytest.mark.parametrize(
    ("message", "cause"),
    [
        (REFUSED_OLD, REFUSED),
        (REFUSED_NEW, REFUSED),
        (NO_BLOB_DRIVER, NO_DRIVER),
        (NO_BLOB_DRIVER.replace("blob.csi", "file.csi"), OTHER),
        (TIMED_OUT, OTHER),
        (OTHER_VOLUME, OTHER),
    ],
)
def test_each_message_reads_as_its_cause(message: str, cause: str) -> None:
    assert mount_cause(message) == cause


def _failed(pod: str, message: str) -> ClusterEvent:
    return ClusterEvent(0.0, "FailedMount", "Pod", pod, message)


def test_each_pod_and_cause_is_said_once_and_a_timeout_after_a_cause_not_at_all() -> None:
    mounts = MountFailures("spot-lab", "spotlab-train")
    pod = "spotlab-train-worker-1"
    first = mounts.line(_failed(pod, REFUSED_OLD))
    assert first == (
        f"FailedMount {pod}: the dataset volume {DATASET} was refused by Blob Storage: the "
        "training identity needs Storage Blob Data Reader on the data container (pulumi up "
        "grants it; a new role assignment can take minutes to apply, and the kubelet keeps "
        "retrying)"
    )
    assert mounts.line(_failed(pod, REFUSED_NEW)) is None
    assert mounts.line(_failed(pod, TIMED_OUT)) is None
    driver = mounts.line(_failed(pod, NO_BLOB_DRIVER))
    assert driver is not None and "storageProfile.blobCSIDriver.enabled" in driver
    # Another pod of the job is said on its own; a pod of another workload not at all.
    assert mounts.line(_failed("spotlab-train-worker-2", REFUSED_OLD)) is not None
    assert mounts.line(_failed("spot-lab-etcd-0", REFUSED_OLD)) is None
    assert mounts.line(ClusterEvent(0.0, "FailedMount", "Node", pod, REFUSED_OLD)) is None


def test_anything_else_names_the_volume_and_points_at_describe() -> None:
    mounts = MountFailures("spot-lab", "spotlab-train")
    line = mounts.line(_failed("spotlab-train-worker-0", OTHER_VOLUME))
    assert line == (
        "FailedMount spotlab-train-worker-0: volume kube-api-access-7xk2p did not mount "
        f"({OTHER_VOLUME}); see kubectl describe pod -n spot-lab spotlab-train-worker-0"
    )
    timeout = mounts.line(_failed("spotlab-train-worker-3", TIMED_OUT))
    assert timeout is not None and timeout.startswith("FailedMount spotlab-train-worker-3: volume")
