"""simulate-eviction against a loopback server that answers like Azure Resource Manager
(tests/support/azure_replay.py): the real ComputeManagementClient runs, over HTTP to 127.0.0.1."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.mgmt.compute import ComputeManagementClient

from lab.azure.simulate_eviction import EvictionError, kubectl_pod_node, main, parse_node_name
from tests.support.azure_replay import FakeAzure as FakeArm
from tests.support.azure_replay import LoopbackTransport, NoSignIn, StaticToken, serve
from tests.support.lab_azure_fixtures import _can_unshare, _offline

SUB = "00000000-0000-0000-0000-00000000abcd"
RG = "MC_spotlab_aks_westus3"
GPU_POOL = "gpu1a2b3c4d"  # derived from the pool's create-only settings (infra/node_pools.py)
GPU_VMSS = f"aks-{GPU_POOL}-12345678-vmss"
SYSTEM_VMSS = "aks-system-87654321-vmss"
ARM = "https://management.azure.com"
API_VERSION = "2026-04-01"  # what azure-mgmt-compute 39 sends
RG_PATH = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.Compute"
VMSS_LIST = f"{RG_PATH}/virtualMachineScaleSets"
GPU_VMS = f"{VMSS_LIST}/{GPU_VMSS}/virtualMachines"


@pytest.fixture
def arm() -> Iterator[FakeArm]:
    yield from serve()


def _factory(arm: FakeArm, credential: Any = None) -> Any:
    def build(subscription: str) -> ComputeManagementClient:
        return ComputeManagementClient(
            credential or StaticToken(), subscription, transport=LoopbackTransport(arm.url)
        )

    return build


def _scale_set(name: str, pool: str, priority: str) -> dict[str, Any]:
    return {
        "name": name,
        "location": "westus3",
        "tags": {"aks-managed-poolName": pool},
        "properties": {"virtualMachineProfile": {"priority": priority}},
    }


def _vm(instance_id: int, power: str = "running") -> dict[str, Any]:
    return {
        "name": f"{GPU_VMSS}_{instance_id}",
        "instanceId": str(instance_id),
        "location": "westus3",
        "properties": {
            "osProfile": {"computerName": f"{GPU_VMSS}{instance_id:06x}"},
            "instanceView": {"statuses": [{"code": f"PowerState/{power}"}]},
        },
    }


def _lab(arm: FakeArm, vms: list[dict[str, Any]] | None = None, gpu_pool: bool = True) -> None:
    """An AKS node resource group: a system pool and (optionally) the GPU Spot pool."""
    sets = [_scale_set(SYSTEM_VMSS, "system", "Regular")]
    if gpu_pool:
        sets.append(_scale_set(GPU_VMSS, "gpu1a2b3c4d", "Spot"))
    arm.routes[("GET", VMSS_LIST)] = (200, {"value": sets})
    if vms is None:
        vms = [_vm(3, "deallocated"), _vm(11), _vm(10)]
    arm.routes[("GET", GPU_VMS)] = (200, {"value": vms})
    for vm in vms:
        path = f"{GPU_VMS}/{vm['instanceId']}/simulateEviction"
        arm.routes[("POST", path)] = (204, None)


def _run(arm: FakeArm, *flags: str, credential: Any = None, resolver: Any = None) -> int:
    def no_kubectl(pod: str, namespace: str) -> str:
        raise AssertionError("the pod resolver must not be called")

    argv = ["--subscription", SUB, "--node-resource-group", RG, "--pool", GPU_POOL, *flags]
    return main(
        argv,
        client_factory=_factory(arm, credential),
        pod_resolver=resolver or no_kubectl,
        environ={},
    )


def _forbidden(action: str) -> tuple[int, dict[str, Any]]:
    message = f"The client 'lab-user' does not have authorization to perform action '{action}'"
    return 403, {"error": {"code": "AuthorizationFailed", "message": message}}


def test_evicts_the_running_instance_with_the_lowest_id(arm: FakeArm, capsys: Any) -> None:
    _lab(arm)
    assert _run(arm) == 0
    assert arm.posts() == [f"{GPU_VMS}/10/simulateEviction"]
    post = arm.seen[-1]
    assert post.query == {"api-version": [API_VERSION]}
    assert post.authorization == "Bearer test-token"
    listing = next(s for s in arm.seen if s.path == GPU_VMS)
    assert listing.query["$expand"] == ["instanceView"]
    assert f"node {GPU_VMSS}00000a" in capsys.readouterr().out


def test_node_name_selects_its_instance(arm: FakeArm) -> None:
    _lab(arm)
    assert _run(arm, "--node", f"{GPU_VMSS}00000b") == 0
    assert arm.posts() == [f"{GPU_VMS}/11/simulateEviction"]


def test_pod_is_resolved_to_its_node(arm: FakeArm) -> None:
    _lab(arm)
    asked: list[tuple[str, str]] = []

    def resolver(pod: str, namespace: str) -> str:
        asked.append((pod, namespace))
        return f"{GPU_VMSS}00000b"

    assert _run(arm, "--pod", "train-worker-1", "-n", "jobs", resolver=resolver) == 0
    assert asked == [("train-worker-1", "jobs")]
    assert arm.posts() == [f"{GPU_VMS}/11/simulateEviction"]


def test_dry_run_reads_but_never_posts(arm: FakeArm, capsys: Any) -> None:
    _lab(arm)
    assert _run(arm, "--instance-id", "11", "--dry-run") == 0
    assert arm.posts() == []
    assert {s.method for s in arm.seen} == {"GET"}
    assert f"would evict node {GPU_VMSS}00000b (instance 11" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("node", "scale_set", "instance_id"),
    [
        (f"{GPU_VMSS}000000", GPU_VMSS, "0"),
        (f"{GPU_VMSS}00000a", GPU_VMSS, "10"),
        (f"{GPU_VMSS}000010", GPU_VMSS, "36"),
        ("aks-gpu2-1-vmss0000zz", "aks-gpu2-1-vmss", "1295"),
    ],
)
def test_node_name_parses_to_scale_set_and_base36_instance(
    node: str, scale_set: str, instance_id: str
) -> None:
    assert parse_node_name(node) == (scale_set, instance_id)


@pytest.mark.parametrize(
    "node", ["gpu-node-1", f"{GPU_VMSS}00000", f"{GPU_VMSS}00000A", "aks-gpu1a2b3c4d-1-vmss-00000a"]
)
def test_unparseable_node_name_fails_before_any_call(arm: FakeArm, capsys: Any, node: str) -> None:
    with pytest.raises(EvictionError, match="aks-<pool>-<digits>-vmss"):
        parse_node_name(node)
    assert _run(arm, "--node", node) == 2
    assert arm.seen == []
    assert f"--node {node!r} is not an AKS scale-set node name" in capsys.readouterr().err


def test_node_of_another_pool_is_refused(arm: FakeArm, capsys: Any) -> None:
    _lab(arm)
    assert _run(arm, "--node", f"{SYSTEM_VMSS}000000") == 2
    assert arm.posts() == []
    assert f"belongs to scale set {SYSTEM_VMSS}" in capsys.readouterr().err


@pytest.mark.parametrize("denied", ["list", "evict"])
def test_forbidden_names_the_role_to_grant(arm: FakeArm, capsys: Any, denied: str) -> None:
    _lab(arm)
    if denied == "list":
        arm.routes[("GET", VMSS_LIST)] = _forbidden(
            "Microsoft.Compute/virtualMachineScaleSets/read"
        )
    else:
        post = ("POST", f"{GPU_VMS}/10/simulateEviction")
        arm.routes[post] = _forbidden("Microsoft.Compute/.../simulateEviction/action")
    assert _run(arm) == 2
    err = capsys.readouterr().err
    assert "Azure denied access (AuthorizationFailed)" in err
    assert "does not have authorization to perform action" in err
    assert "'Virtual Machine Contributor' role there" in err
    assert RG in err


def test_unknown_resource_group_says_which_flag_to_fix(arm: FakeArm, capsys: Any) -> None:
    body = {"error": {"code": "ResourceGroupNotFound", "message": f"'{RG}' could not be found"}}
    arm.routes[("GET", VMSS_LIST)] = (404, body)
    assert _run(arm) == 2
    err = capsys.readouterr().err
    assert f"resource group {RG} not found in subscription {SUB}" in err
    assert "--node-resource-group" in err


def test_missing_pool_lists_the_scale_sets_found(arm: FakeArm, capsys: Any) -> None:
    _lab(arm, gpu_pool=False)
    assert _run(arm) == 2
    assert arm.posts() == []
    err = capsys.readouterr().err
    assert f"no scale set for pool 'gpu1a2b3c4d' in resource group {RG}" in err
    assert f"scale sets found: {SYSTEM_VMSS}" in err


def test_pool_that_is_not_spot_is_refused(arm: FakeArm, capsys: Any) -> None:
    _lab(arm)
    assert _run(arm, "--pool", "system") == 2
    assert arm.posts() == []
    assert "is not Spot (priority Regular)" in capsys.readouterr().err


def test_missing_instance_lists_the_instances(arm: FakeArm, capsys: Any) -> None:
    _lab(arm)
    assert _run(arm, "--instance-id", "99") == 2
    assert arm.posts() == []
    assert f"instance 99 not found in scale set {GPU_VMSS} (instances: 3, 10, 11)" in (
        capsys.readouterr().err
    )


def test_no_running_instance_says_the_pool_is_empty(arm: FakeArm, capsys: Any) -> None:
    _lab(arm, vms=[_vm(4, "deallocated")])
    assert _run(arm) == 2
    assert "no running instance" in capsys.readouterr().err


def test_missing_credentials_say_az_login(arm: FakeArm, capsys: Any) -> None:
    _lab(arm)
    assert _run(arm, credential=NoSignIn()) == 2
    assert arm.seen == []  # the token is fetched before anything is sent
    err = capsys.readouterr().err
    assert "no usable Azure credentials: run `az login`" in err
    assert f"an account that can reach subscription {SUB}" in err


def test_a_sign_in_it_cannot_mirror_is_one_line(
    capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sign-in rule is pulumi up's (catalog/deployer.py): OIDC has no kubelogin twin.
    monkeypatch.setenv("ARM_USE_OIDC", "true")
    argv = ["--subscription", SUB, "--node-resource-group", RG, "--pool", GPU_POOL]
    assert main([*argv, "--node", f"{GPU_VMSS}00000b"], environ={}) == 2
    err = capsys.readouterr().err
    assert err.startswith("simulate-eviction: error: azure-native:useOidc (ARM_USE_OIDC)")
    assert len(err.splitlines()) == 1


def test_missing_subscription_fails_before_signing_in(capsys: Any) -> None:
    def no_client(subscription: str) -> Any:
        raise AssertionError("no client without a subscription")

    argv = ["--node-resource-group", RG]
    assert main(argv, client_factory=no_client, environ={}) == 2
    assert "pass --subscription or set AZURE_SUBSCRIPTION_ID" in capsys.readouterr().err


def test_stack_outputs_and_environment_fill_in_the_flags(arm: FakeArm, tmp_path: Path) -> None:
    _lab(arm)
    outputs = tmp_path / "outputs.json"
    outputs.write_text(
        json.dumps({"nodeResourceGroup": RG, "clusterName": "aks", "gpuPoolName": GPU_POOL})
    )
    argv = ["--stack-outputs", str(outputs), "--instance-id", "11"]
    env = {"AZURE_SUBSCRIPTION_ID": SUB}
    assert main(argv, client_factory=_factory(arm), environ=env) == 0
    assert arm.posts() == [f"{GPU_VMS}/11/simulateEviction"]


def test_the_pool_name_comes_from_the_outputs_or_a_flag(tmp_path: Path, capsys: Any) -> None:
    # The GPU pool's name follows its settings, so there is no fixed default to fall back to.
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({"nodeResourceGroup": RG}))
    argv = ["--stack-outputs", str(outputs), "--subscription", SUB]
    assert main(argv, environ={}) == 2
    err = capsys.readouterr().err
    assert f"no GPU pool name (--stack-outputs {outputs} has none)" in err
    assert "pass --pool" in err


def test_stack_outputs_without_resource_group(tmp_path: Path, capsys: Any) -> None:
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({"clusterName": "aks"}))
    argv = ["--stack-outputs", str(outputs), "--subscription", SUB]
    assert main(argv, environ={}) == 2
    assert f"no node resource group (--stack-outputs {outputs} has none)" in (
        capsys.readouterr().err
    )


def _fake_kubectl(directory: Path, script: str) -> None:
    kubectl = directory / "kubectl"
    kubectl.write_text(f"#!/bin/sh\n{script}\n")
    kubectl.chmod(0o755)


@pytest.mark.usefixtures("processes")
def test_kubectl_resolver_asks_for_the_pods_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_kubectl(tmp_path, f'echo "$@" > {tmp_path}/argv; printf {GPU_VMSS}00000a')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert kubectl_pod_node("w-1", "spot-lab") == f"{GPU_VMSS}00000a"
    argv = (tmp_path / "argv").read_text().split()
    assert argv == ["get", "pod", "w-1", "-n", "spot-lab", "-o", "jsonpath={.spec.nodeName}"]


@pytest.mark.usefixtures("processes")
def test_kubectl_resolver_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EvictionError, match="needs a working kubectl on PATH"):
        kubectl_pod_node("w-1", "spot-lab")
    _fake_kubectl(tmp_path, "echo 'pods \"w-1\" not found' >&2; exit 1")
    with pytest.raises(EvictionError, match='kubectl failed: pods "w-1" not found'):
        kubectl_pod_node("w-1", "spot-lab")
    _fake_kubectl(tmp_path, "exit 0")
    with pytest.raises(EvictionError, match="not scheduled on a node yet"):
        kubectl_pod_node("w-1", "spot-lab")


@pytest.mark.usefixtures("processes")
@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -n` (a network namespace)")
def test_with_no_sign_in_and_no_network_it_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It signs in as pulumi up deploys (ARM_* or az login), never DefaultAzureCredential,
    # which probed the instance metadata address and printed every credential it tried.
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({"nodeResourceGroup": "MC_rg", "gpuPoolName": "gpu1"}))
    tools = tmp_path / "bin"  # unshare, and no az even where one is installed
    tools.mkdir()
    (tools / "unshare").symlink_to(shutil.which("unshare") or "unshare")
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", "00000000-0000-0000-0000-000000000000")
    for name in ("ARM_CLIENT_ID", "ARM_CLIENT_SECRET", "ARM_TENANT_ID", "ARM_USE_MSI"):
        monkeypatch.delenv(name, raising=False)
    done = _offline(["simulate-eviction", "--stack-outputs", str(outputs), "--dry-run"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("simulate-eviction: error: no usable Azure credentials")
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "ManagedIdentityCredential" not in done.stderr
