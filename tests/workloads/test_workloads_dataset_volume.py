"""The dataset's Blob CSI volume: keyless, read-only, bound by name, and what the workers read.

Each attribute is the one the driver's source reads (kubernetes-sigs/blob-csi-driver at v1.25.6,
v1.26.14 and v1.27.0):

- ``pkg/blob/blob.go`` ``GetAuthEnv``: with ``clientid`` set and ``mountwithworkloadidentitytoken``
  parsed true (``strconv.ParseBool``, so the string "true"), it hands blobfuse2
  ``AZURE_STORAGE_SPN_CLIENT_ID`` and the pod's token and returns before
  ``GetStorageAccesskeyFromServiceAccountToken``; with ``clientid`` alone it fetches the
  account key, which needs shared keys (off on our account). Attribute names are matched
  case-insensitively there.
- ``pkg/blob/nodeserver.go`` ``NodePublishVolume``: a volume with ``clientID`` and the pod's
  token is mounted per pod, skipping ``NodeStageVolume``; ``isReadOnlyFromCapability``
  adds ``-o ro`` to blobfuse2 for a ReadOnlyMany (MULTI_NODE_READER_ONLY) capability, which
  is the only way read-only reaches blobfuse on this path.
- ``deploy/csi-blob-driver.yaml``: ``tokenRequests`` with audience api://AzureADTokenExchange
  from v1.25 (the pod's token), ``requiresRepublish`` from v1.27.0.
- ``docs/workload-identity-static-pv-mount.md``: the static PV with ``clientID`` and
  ``mountWithWorkloadIdentityToken: "true"``; the identity needs a Storage Blob Data role.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from infra.roles import STORAGE_BLOB_DATA_READER
from tests.support.pulumi_harness import ProgramRun, run_program
from workloads.manifests.volume import (
    DatasetVolumeSpec,
    dataset_persistent_volume,
    dataset_volume_claim,
)

STACKS = ["dev", "a100"]
PV = "kubernetes:core/v1:PersistentVolume"
PVC = "kubernetes:core/v1:PersistentVolumeClaim"
PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"
ROLE = "azure-native:authorization:RoleAssignment"
# Attributes that would make the driver use a key, a secret or a node-wide identity.
KEY_PATHS = (
    "azurestorageauthtype",
    "azurestorageidentityclientid",
    "azurestorageaccountkey",
    "secretname",
    "secretnamespace",
    "nodestagesecretref",
    "nodepublishsecretref",
    "getlatestaccountkey",
    "sastoken",
    "keyvaulturl",
)


def _spec(**overrides: Any) -> DatasetVolumeSpec:
    values: dict[str, Any] = {
        "name": "spot-lab-dataset",
        "namespace": "spot-lab",
        "storage_account": "spotlabst1a2b3c4d",
        "resource_group": "spotlab-dev-rg",
        "container": "data",
        "client_id": "00000000-0000-0000-0000-0000000000bb",
    }
    return DatasetVolumeSpec(**{**values, **overrides})


def test_the_pv_mounts_with_the_pods_token_and_no_key() -> None:
    pv = dataset_persistent_volume(_spec())
    csi = pv["spec"]["csi"]
    assert csi["driver"] == "blob.csi.azure.com"
    assert csi["volumeAttributes"] == {
        "protocol": "fuse2",
        "storageAccount": "spotlabst1a2b3c4d",
        "resourceGroup": "spotlab-dev-rg",
        "containerName": "data",
        "clientID": "00000000-0000-0000-0000-0000000000bb",
        "mountWithWorkloadIdentityToken": "true",
    }
    text = json.dumps(pv).lower()
    assert not [path for path in KEY_PATHS if path in text]


def test_read_only_comes_from_the_access_mode_and_is_said_twice() -> None:
    pv, pvc = dataset_persistent_volume(_spec()), dataset_volume_claim(_spec())
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pv["spec"]["csi"]["readOnly"] is True
    # Deleting the claim or the stack never deletes the container.
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"


def test_the_claim_binds_to_exactly_this_volume() -> None:
    pv, pvc = dataset_persistent_volume(_spec()), dataset_volume_claim(_spec())
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    # "" (not absent): the default StorageClass must not provision a new volume instead.
    assert pv["spec"]["storageClassName"] == pvc["spec"]["storageClassName"] == ""
    assert pvc["spec"]["resources"]["requests"]["storage"] == pv["spec"]["capacity"]["storage"]


def test_the_non_root_workers_can_read_the_fuse_mount() -> None:
    # blobfuse2 runs as root; the workers as UID 10001 (training/Dockerfile).
    assert "-o allow_other" in dataset_persistent_volume(_spec())["spec"]["mountOptions"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"client_id": ""}, "client_id must not be empty"),
        ({"storage_account": ""}, "storage_account must not be empty"),
        ({"container": "a/b"}, "must not contain '#' or '/'"),
    ],
)
def test_a_volume_that_cannot_mount_is_refused(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataset_persistent_volume(_spec(**overrides))


# ---- the whole program, per stack --------------------------------------------------------------


@pytest.fixture(scope="module", params=STACKS)
def run(request: pytest.FixtureRequest) -> ProgramRun:
    return run_program(request.param)


def _worker(run: ProgramRun) -> dict[str, Any]:
    return run.one(PYTORCHJOB).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]


def test_one_read_only_pv_for_the_data_container_as_the_training_identity(run: ProgramRun) -> None:
    pv = run.one(PV).inputs
    attributes = pv["spec"]["csi"]["volumeAttributes"]
    assert pv["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert attributes["mountWithWorkloadIdentityToken"] == "true"
    assert attributes["clientID"] == run.outputs["trainingClientId"]
    assert attributes["containerName"] == run.outputs["dataContainer"]
    assert not [path for path in KEY_PATHS if path in json.dumps(pv).lower()]
    claim = run.one(PVC).inputs
    assert claim["spec"]["volumeName"] == pv["metadata"]["name"]


def test_the_workers_mount_it_read_only_and_read_the_data_through_it(run: ProgramRun) -> None:
    template = _worker(run)
    claim = run.one(PVC).inputs["metadata"]["name"]
    (volume,) = [v for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
    (container,) = template["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    # training/agent.py copies TRAIN_DATA_URI (the mount) to TRAIN_DATA_DIR before joining.
    assert env["TRAIN_DATA_URI"] == mount["mountPath"]
    # The mount signs in as the workers' ServiceAccount, which the training identity trusts.
    account = run.one("kubernetes:core/v1:ServiceAccount", "namespace").inputs["metadata"]
    assert template["spec"]["serviceAccountName"] == account["name"]


def test_the_training_identity_may_read_data_and_no_node_identity_may(run: ProgramRun) -> None:
    """blobfuse2's mount check lists the container: Storage Blob Data Reader there is enough."""
    identity = run.one("azure-native:managedidentity:UserAssignedIdentity", "training")
    data = next(
        c.id
        for c in run.of_type("azure-native:storage:BlobContainer")
        if c.inputs["containerName"] == "data"
    )
    readers = [
        r.inputs
        for r in run.of_type(ROLE)
        if r.inputs["scope"] == data
        and r.inputs["roleDefinitionId"].endswith(STORAGE_BLOB_DATA_READER)
    ]
    assert [r["principalId"] for r in readers] == [identity.outputs["principalId"]]
    kubelet = run.one("azure-native:containerservice:ManagedCluster").outputs["identityProfile"]
    node_identity = kubelet["kubeletidentity"]["objectId"]
    storage = run.one("azure-native:storage:StorageAccount").id
    assert not [
        r
        for r in run.of_type(ROLE)
        if r.inputs["principalId"] == node_identity and r.inputs["scope"].startswith(storage)
    ]


def test_the_volume_exists_before_the_job_and_goes_after_it(run: ProgramRun) -> None:
    job = run.one(PYTORCHJOB)
    for volume in (run.one(PV), run.one(PVC)):
        assert run.waits_for(job, volume)
