"""The data-staging Job's manifest: valid Kubernetes, on the system pool, named by its source."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.test_workloads_cluster_objects import validate_strictly
from workloads.manifests.data_staging import (
    DataStagingSpec,
    staging_job_manifest,
    staging_job_name,
)

SPEC = DataStagingSpec(
    job_prefix="spotlab-train",
    namespace="spot-lab",
    image="reg.azurecr.io/spot-lab-trainer:abc",
    service_account="data-stager",
    source_url="https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
    checksum="md5:c32a1d4ab5d03f1284b67883e8d87530",
    container_uri="https://acct.blob.core.windows.net/data",
)


def test_the_job_is_valid_kubernetes_and_bounded() -> None:
    manifest = staging_job_manifest(SPEC)
    validate_strictly(manifest)
    spec = manifest["spec"]
    # Bounded: a broken mirror fails pulumi up within the hour instead of waiting forever.
    assert spec["backoffLimit"] == 3 and spec["activeDeadlineSeconds"] == 3600
    assert spec["template"]["spec"]["restartPolicy"] == "Never"


def test_the_name_follows_source_and_checksum_only() -> None:
    assert staging_job_name(SPEC) == staging_job_name(replace(SPEC, image="reg/x:other"))
    assert staging_job_name(SPEC) != staging_job_name(replace(SPEC, checksum="md5:" + "0" * 32))
    assert len(staging_job_name(SPEC)) <= 63


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"container_uri": "http://acct/data"}, "container_uri must be an https:// URL"),
        ({"image": "reg.azurecr.io/spot-lab-trainer"}, "image must carry an explicit tag"),
    ],
)
def test_bad_specs_name_the_field(change: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        staging_job_manifest(replace(SPEC, **change))
