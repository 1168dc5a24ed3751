"""The data-staging Job's manifest: valid Kubernetes, on the system pool, named by its source."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.workload_specs import validate_strictly
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


# ---- a failed staging Job is replaced by the next `pulumi up` ------------------------------------


def provider_plans_replacement(new_inputs: dict, live: dict) -> tuple[bool, bool]:
    """(replace, delete first) as pulumi-kubernetes' Diff decides it for a Job whose spec did
    not change, transcribed from provider/pkg/provider/provider.go (Diff): when the new inputs
    carry ``pulumi.com/replaceUnready: "true"``, it reads the live Job and asks the Job checker
    (provider/pkg/await/checker/job/check.go: ready = ``status.startTime`` set and a
    ``Complete`` condition with status True); an unready Job is replaced. A replacement of an
    object with the same user-given name in the same namespace is delete-before-replace.
    """
    annotations = new_inputs["metadata"].get("annotations") or {}
    if annotations.get("pulumi.com/replaceUnready") != "true":
        return False, False
    status = live.get("status") or {}
    complete = any(
        c["type"] == "Complete" and c["status"] == "True" for c in status.get("conditions", [])
    )
    replace_it = not (status.get("startTime") and complete)
    same_name = new_inputs["metadata"]["name"] == live["metadata"]["name"]
    same_namespace = new_inputs["metadata"]["namespace"] == live["metadata"]["namespace"]
    return replace_it, replace_it and same_name and same_namespace


def _live(manifest: dict, conditions: list[dict]) -> dict:
    return {**manifest, "status": {"startTime": "2026-11-25T10:00:00Z", "conditions": conditions}}


def test_a_failed_staging_job_is_replaced_on_the_next_up() -> None:
    manifest = staging_job_manifest(SPEC)
    assert manifest["metadata"]["annotations"] == {"pulumi.com/replaceUnready": "true"}
    failed = _live(
        manifest,
        [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "x"}],
    )
    # Same source, so the same name: without the annotation the next up met the Failed Job.
    assert provider_plans_replacement(staging_job_manifest(SPEC), failed) == (True, True)


def test_a_staging_job_that_completed_is_left_alone() -> None:
    manifest = staging_job_manifest(SPEC)
    done = _live(manifest, [{"type": "Complete", "status": "True"}])
    assert provider_plans_replacement(staging_job_manifest(SPEC), done) == (False, False)


def test_without_the_annotation_a_failed_job_stays_failed() -> None:
    manifest = staging_job_manifest(SPEC)
    bare = {
        **manifest,
        "metadata": {k: v for k, v in manifest["metadata"].items() if k != "annotations"},
    }
    failed = _live(manifest, [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}])
    assert provider_plans_replacement(bare, failed) == (False, False)
