"""The builders in ``workloads.manifests`` stay importable without pulumi, for the local lab."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workloads.manifests.etcd import RENDEZVOUS_SERVER_FLAGS, EtcdSpec, etcd_command

PROJECT_DIR = Path(__file__).resolve().parent.parent.parent
MANIFESTS = sorted(
    f"workloads.manifests.{p.stem}"
    for p in (PROJECT_DIR / "workloads" / "manifests").glob("*.py")
    if p.stem != "__init__"
)
# What a machine with only the lab's dependencies lacks.
BLOCKED = ("pulumi", "pulumi_kubernetes", "pulumi_azure_native", "pulumi_command", "kubernetes")


def _import_without_pulumi(modules: list[str]) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter: this one has pulumi imported already. A None entry in
    # sys.modules makes any import of that name (or its submodules) fail.
    code = "\n".join(
        [
            "import importlib, sys",
            *(f"sys.modules[{name!r}] = None" for name in BLOCKED),
            *(f"importlib.import_module({module!r})" for module in modules),
        ]
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=60
    )


@pytest.mark.usefixtures("processes")
def test_manifest_builders_import_without_pulumi() -> None:
    assert "workloads.manifests.etcd" in MANIFESTS
    result = _import_without_pulumi(["workloads", *MANIFESTS])
    assert result.returncode == 0, result.stderr


@pytest.mark.usefixtures("processes")
def test_the_check_does_catch_a_pulumi_import() -> None:
    result = _import_without_pulumi(["workloads.etcd"])
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr or "ImportError" in result.stderr


def test_cluster_etcd_runs_with_the_shared_rendezvous_flags() -> None:
    command = etcd_command(EtcdSpec(namespace="spot-lab", priority_class="p"))
    assert not [flag for flag in RENDEZVOUS_SERVER_FLAGS if "v2" in flag]
    assert set(RENDEZVOUS_SERVER_FLAGS) <= set(command)
