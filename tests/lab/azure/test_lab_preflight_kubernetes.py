"""``lab preflight``'s check of the Kubernetes version against what AKS offers in the region,
and the Blob CSI driver line of that version, from recorded answers of
``ManagedClusters_ListKubernetesVersions`` (Azure/azure-rest-api-specs,
``Microsoft.ContainerService/aks/stable/2026-05-01``, ``examples/KubernetesVersions_List.json``:
``values[]`` with ``version``, ``isDefault``, ``isPreview``, ``patchVersions`` and
``capabilities.supportPlan``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lab.azure.preflight.kubernetes_version import AKS_API_VERSION, describe_offered
from tests.support.azure_replay import FakeAzure
from tests.support.lab_azure_fixtures import AKS_VERSIONS, _preflight, scratch_project

# No preflight here reaches Docker Hub: it answers from loopback.
pytestmark = pytest.mark.usefixtures("hub")


def _with_version(
    azure: FakeAzure, tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str
) -> tuple[int, dict[str, Any]]:
    project = scratch_project(tmp_path, kubernetesVersion=version)
    return _preflight(azure, capsys, "--stack", "test", project=project)


@pytest.mark.usefixtures("processes")
def test_an_empty_version_reports_aks_default_and_its_driver(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys)
    assert code == 0
    assert checks["Kubernetes version"] == {
        "name": "Kubernetes version",
        "status": "ok",
        "detail": "AKS's default, 1.34; offered in westus3: 1.31 (LTS only), 1.33, 1.34 "
        "(default), 1.35, 1.36 (preview)",
        "fix": "",
    }
    assert checks["Blob CSI driver"]["detail"].startswith(
        "v1.27 on AKS 1.34 (refreshes a mounted token); the workers copy the dataset"
    )
    (asked,) = [s for s in azure.seen if s.path == AKS_VERSIONS]
    assert asked.query["api-version"] == [AKS_API_VERSION]
    assert asked.authorization and asked.authorization.startswith("Bearer ")


@pytest.mark.parametrize(
    ("version", "driver"),
    [("1.33", "v1.26 on AKS 1.33 (never refreshes"), ("1.33.5", "v1.26 on AKS 1.33.5 (never")],
)
@pytest.mark.usefixtures("processes")
def test_an_offered_version_passes_and_names_its_driver_line(
    version: str,
    driver: str,
    azure: FakeAzure,
    tools: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, checks = _with_version(azure, tmp_path, capsys, version)
    assert code == 0
    assert checks["Kubernetes version"]["detail"].startswith(f"{version}; offered in westus3")
    assert checks["Blob CSI driver"]["detail"].startswith(driver)


@pytest.mark.parametrize(
    ("version", "detail"),
    [
        ("1.30", "1.30 is not offered in westus3: 1.31 (LTS only), 1.33, 1.34 (default)"),
        ("1.33.9", "1.33.9 is not offered in westus3; 1.33 has 1.33.4, 1.33.5"),
        ("1.31", "1.31 is offered only with long-term support (Premium tier)"),
    ],
)
@pytest.mark.usefixtures("processes")
def test_a_version_the_region_does_not_offer_fails_with_the_offered_list(
    version: str,
    detail: str,
    azure: FakeAzure,
    tools: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, checks = _with_version(azure, tmp_path, capsys, version)
    assert code == 1
    check = checks["Kubernetes version"]
    assert check["status"] == "fails"
    assert check["detail"].startswith(detail)
    assert check["fix"] == (
        "pulumi config set spot-lab:kubernetesVersion <one of those>, or empty for AKS's default"
    )
    assert "Blob CSI driver" not in checks


@pytest.mark.usefixtures("processes")
def test_a_preview_version_only_warns(
    azure: FakeAzure, tools: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _with_version(azure, tmp_path, capsys, "1.36")
    assert code == 0
    assert checks["Kubernetes version"]["status"] == "warning"
    assert "1.36 is a preview version in westus3" in checks["Kubernetes version"]["detail"]


@pytest.mark.usefixtures("processes")
def test_a_provider_that_is_not_registered_is_azures_own_line(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = "The subscription is not registered to use namespace 'Microsoft.ContainerService'."
    error = {"error": {"code": "MissingSubscriptionRegistration", "message": message}}
    azure.routes[("GET", AKS_VERSIONS)] = (409, error)
    code, checks = _preflight(azure, capsys)
    assert code == 1
    assert (
        checks["Kubernetes version"]["detail"] == f"409 MissingSubscriptionRegistration: {message}"
    )
    assert checks["ACR Tasks"]["status"] == "ok"


def test_the_offered_list_is_in_version_order() -> None:
    values = [{"version": "1.10"}, {"version": "1.9", "isDefault": True}]
    assert describe_offered(values) == "1.9 (default), 1.10"
