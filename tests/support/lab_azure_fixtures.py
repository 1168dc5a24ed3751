"""What the lab's Azure tools' tests share: a subscription recorded as Azure answers it, fake
local tools on PATH (a ``pulumi`` printing a stack's outputs too), stack files in a scratch
project, preflight run against it (``--json``), and a command run with no network at all."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catalog.deployer import AZURE_CLI_APP_ID
from lab.azure.clients import Azure, reach
from lab.azure.preflight.command import main
from lab.azure.preflight.subscription import PROVIDERS
from tests.support.azure_replay import (
    FakeAzure,
    LoopbackTransport,
    StaticToken,
    recording,
    serve,
)

PROJECT_DIR = Path(__file__).resolve().parent.parent.parent
SUB = "00000000-0000-0000-0000-00000000abcd"
OTHER_SUB = "00000000-0000-0000-0000-00000000ffff"
OID = "11111111-2222-3333-4444-555555555555"
SUB_PATH = f"/subscriptions/{SUB}"
SKUS = f"{SUB_PATH}/providers/Microsoft.Compute/skus"
USAGES = f"{SUB_PATH}/providers/Microsoft.Compute/locations/westus3/usages"
ROLE_ASSIGNMENTS = f"{SUB_PATH}/providers/Microsoft.Authorization/roleAssignments"
ROLE_DEFINITIONS = f"{SUB_PATH}/providers/Microsoft.Authorization/roleDefinitions"
AKS_VERSIONS = (
    f"{SUB_PATH}/providers/Microsoft.ContainerService/locations/westus3/kubernetesVersions"
)
TENANT = "00000000-0000-0000-0000-0000000000aa"
ROLES = {
    "owner": "8e3af657-a8ff-443c-a75c-2fe8c4bcb635",
    "contributor": "b24988ac-6180-42a0-ab88-20f7382dd24c",
    "user_access_administrator": "18d7d88d-d35e-4fb5-a5c3-7773c20a72d9",
    "reader": "acdd72a7-3385-48ef-bd42-f606fba81ae7",
}
RETAIL = "/api/retail/prices"
GRAPH = "/providers/Microsoft.ResourceGraph/resources"


def provider(namespace: str, state: str = "Registered") -> dict[str, Any]:
    """Providers - Get: the fields the check reads, as ARM names them."""
    return {
        "id": f"{SUB_PATH}/providers/{namespace}",
        "namespace": namespace,
        "registrationState": state,
        "registrationPolicy": "RegistrationRequired",
        "resourceTypes": [],
    }


def subscription_routes(fake: FakeAzure) -> None:
    """A pay-as-you-go subscription where the dev stack fits exactly."""
    fake.routes[("GET", SUB_PATH)] = (200, recording("subscription.json"))
    for namespace in PROVIDERS:
        fake.routes[("GET", f"{SUB_PATH}/providers/{namespace}")] = (200, provider(namespace))
    # Page 2 first: its URL also matches the page-1 route.
    fake.routes[("GET", SKUS, "$skiptoken=page2")] = (200, recording("resource_skus_page2.json"))
    fake.routes[("GET", SKUS)] = (200, recording("resource_skus_page1.json"))
    fake.routes[("GET", USAGES)] = (200, recording("usages.json"))
    fake.routes[("GET", ROLE_ASSIGNMENTS)] = (200, recording("role_assignments.json"))
    for name, guid in ROLES.items():
        body = recording(f"role_definition_{name}.json")
        fake.routes[("GET", f"{ROLE_DEFINITIONS}/{guid}")] = (200, body)
    fake.routes[("GET", AKS_VERSIONS)] = (200, recording("kubernetes_versions_westus3.json"))


def price_routes(fake: FakeAzure) -> None:
    """The Retail Prices API's answers for the T4 size, the CPU pool and the fixed meters."""
    routes = {
        "$skip=20": "prices_nc4as_t4_v3_page2.json",
        "armSkuName eq 'Standard_NC4as_T4_v3'": "prices_nc4as_t4_v3_page1.json",
        "armSkuName eq 'Standard_D2s_v5'": "prices_d2s_v5_westus3.json",
        "serviceName eq 'Load Balancer'": "prices_load_balancer.json",
        "serviceName eq 'Virtual Network'": "prices_virtual_network.json",
        "serviceName eq 'Container Registry'": "prices_container_registry.json",
    }
    for fragment, name in routes.items():
        fake.routes[("GET", RETAIL, fragment)] = (200, recording(name))


def eviction_routes(fake: FakeAzure) -> None:
    pages = [(200, recording("eviction_page1.json")), (200, recording("eviction_page2.json"))]
    fake.routes[("POST", GRAPH)] = pages


def replay_azure(fake: FakeAzure, credential: Any = None, **environ: str) -> Azure:
    """An ``Azure`` whose clients talk to the fake, signed in as the recorded user (through the
    Azure CLI, whose application id an ARM token carries in ``appid``)."""
    claims = {"oid": OID, "upn": "ada@example.com", "tid": TENANT, "appid": AZURE_CLI_APP_ID}
    return Azure(
        credential=credential or StaticToken(claims),
        transport=lambda: LoopbackTransport(fake.url, fake.slept),
        probe=lambda url: reach(fake.url),
        environ=dict(environ),
    )


def fake_tools(
    bin_dir: Path, account: dict[str, Any] | None, *, skip: tuple[str, ...] = ()
) -> Path:
    """Scripts named like the tools preflight runs, answering as the real ones do.

    ``account`` is what ``az account show`` prints (None: not signed in); ``az account show
    --subscription X`` works for the subscriptions listed in ``account["_reachable"]``.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    answers = {
        "pulumi": 'case "$*" in "stack --show-name"*) echo dev;; *) echo v3.210.0;; esac',
        "git": "echo 'git version 2.47.1'",
        "kubelogin": "echo 'kubelogin version'; echo 'git hash: v0.2.10/0a1b2c3d'",
        "kubectl": "echo 'Client Version: v1.33.2'",
        "docker": "echo 28.3.1",
    }
    data = bin_dir / "account.json"
    if account is None:
        data.unlink(missing_ok=True)
    else:
        data.write_text(json.dumps(account))
    reachable = " ".join((account or {}).get("_reachable", []))
    answers["az"] = f"""
case "$*" in
  version*) echo 2.79.0;;
  "account show --subscription "*)
    for s in {reachable}; do [ "$4" = "$s" ] && {{ echo '{{}}'; exit 0; }}; done
    echo "ERROR: Subscription '$4' not found. Check the spelling and casing and try again." >&2
    exit 1;;
  "account show"*)
    [ -f {data} ] || {{ echo "ERROR: Please run 'az login' to setup account." >&2; exit 1; }}
    exec /bin/cat {data};;
esac"""
    for name, script in answers.items():
        path = bin_dir / name
        if name in skip:
            path.unlink(missing_ok=True)
            continue
        path.write_text(f"#!/bin/sh\n{script}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def fake_pulumi(bin_dir: Path, outputs: dict[str, str]) -> Path:
    """``pulumi stack output --json`` printing ``outputs``, as the CLI does for a stack."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "outputs.json").write_text(json.dumps(outputs))
    script = bin_dir / "pulumi"
    script.write_text(
        '#!/bin/sh\ncase "$*" in "stack output --json --stack "*) '
        f"exec /bin/cat {bin_dir / 'outputs.json'};; *) exit 1;; esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def az_account(subscription: str = SUB, reachable: tuple[str, ...] = ()) -> dict[str, Any]:
    """``az account show``'s JSON."""
    return {
        "id": subscription,
        "name": "Spot lab (pay-as-you-go)",
        "state": "Enabled",
        "tenantId": TENANT,
        "isDefault": True,
        "user": {"name": "ada@example.com", "type": "user"},
        "_reachable": list(reachable),
    }


def scratch_project(tmp_path: Path, stack: str = "test", **values: str) -> Path:
    """A project dir with this repo's Pulumi.yaml and a stack file setting ``values``."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    shutil.copy(PROJECT_DIR / "Pulumi.yaml", project / "Pulumi.yaml")
    config = {k if ":" in k else f"spot-lab:{k}": v for k, v in values.items()}
    (project / f"Pulumi.{stack}.yaml").write_text(json.dumps({"config": config}))
    return project


@pytest.fixture(name="azure")
def subscription_served() -> Iterator[FakeAzure]:
    """The ``azure`` fixture: the subscription of ``subscription_routes`` on loopback."""
    for fake in serve():
        subscription_routes(fake)
        yield fake


@pytest.fixture(name="tools")
def tools_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The ``tools`` fixture: the fake tools alone on PATH, signed in to az, with no proxy in
    the way of loopback."""
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    bin_dir = fake_tools(tmp_path / "bin", az_account())
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def _preflight(
    fake: FakeAzure,
    capsys: pytest.CaptureFixture[str],
    *flags: str,
    project: Path = PROJECT_DIR,
    credential: Any = None,
    registry: Any = None,
    **environ: str,
) -> tuple[int, dict[str, Any]]:
    """Run with --json; (exit code, {check name: check})."""
    azure = replay_azure(fake, credential, **environ)
    code = main(["--json", *flags], azure, project, registry=registry)
    out = capsys.readouterr().out
    report = json.loads(out)
    return code, {c["name"]: c for c in report.get("checks", [])} | {"_report": report}


def _offline(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # an empty cache: prices must ask the API
    return subprocess.run(
        ["unshare", "-n", sys.executable, "-m", "lab", *argv],
        cwd=PROJECT_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard, not a speed target
    )


def _can_unshare() -> bool:
    tool = shutil.which("unshare")
    return tool is not None and subprocess.run([tool, "-n", "true"]).returncode == 0
