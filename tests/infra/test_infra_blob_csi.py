"""Which Blob CSI driver AKS runs per Kubernetes version, and whether it refreshes a mounted
token (Azure/AKS CHANGELOG; blob-csi-driver ``deploy/csi-blob-driver.yaml``: no
``requiresRepublish`` before v1.27.0, ``requiresRepublish: true`` with ``expirationSeconds:
3600`` from it). The dataset is copied from the mount when a pod starts, so every line works;
``lab preflight`` can say which one a stack's version gets."""

from __future__ import annotations

import pytest

from catalog.blob_csi import DRIVER, FIRST_REFRESHING, aks_minor, driver_line


@pytest.mark.parametrize(
    ("version", "driver", "refreshes"),
    [
        ("1.31", "v1.25", False),
        ("1.32.4", "v1.26", False),
        ("1.33", "v1.26", False),
        ("1.34", "v1.27", True),
        ("1.36.1", "v1.27 or later", True),
    ],
)
def test_driver_line_per_aks_version(version: str, driver: str, refreshes: bool) -> None:
    line = driver_line(version)
    assert line is not None
    assert (line.driver, line.refreshes_token) == (driver, refreshes)


def test_versions_older_than_the_table_are_unknown_and_junk_is_refused() -> None:
    assert driver_line("1.30") is None
    assert aks_minor("1.34.0") == FIRST_REFRESHING
    with pytest.raises(ValueError, match="not a Kubernetes version"):
        aks_minor("latest")
    assert DRIVER == "blob.csi.azure.com"
