"""Who may reach the cluster: Entra ID with Azure RBAC, no local accounts, no credential in the
state, the deployer as admin signing in as itself, and an optional allow-list for the API
server. Per stack file, under the mocks."""

from __future__ import annotations

import pytest
import yaml

from catalog.deployer import AZURE_CLI_LOGIN, DeployerSignIn
from infra.kubeconfig import deployer_kubeconfig, has_credential
from infra.roles import AKS_RBAC_CLUSTER_ADMIN
from stack_config import ConfigError, load, validate
from tests.support.pulumi_harness import (
    AKS_SERVER_ID,
    TENANT_ID,
    ProgramRun,
    fake_kubeconfig,
    fake_uuid,
    run_program,
)

AS_USER = DeployerSignIn(AZURE_CLI_LOGIN)

CLUSTER = "azure-native:containerservice:ManagedCluster"
ROLE = "azure-native:authorization:RoleAssignment"


@pytest.fixture(params=["dev", "a100"], scope="module")
def run(request: pytest.FixtureRequest) -> ProgramRun:
    return run_program(request.param)


def test_the_cluster_signs_in_through_entra_id_only(run: ProgramRun) -> None:
    cluster = run.one(CLUSTER).inputs
    assert cluster["aadProfile"] == {"managed": True, "enableAzureRBAC": True}
    # No local accounts: listClusterAdminCredential has no certificate to hand out.
    assert cluster["disableLocalAccounts"] is True
    assert "apiServerAccessProfile" not in cluster  # public by default, Entra ID still needed


def test_the_deployer_is_cluster_admin_through_azure_rbac(run: ProgramRun) -> None:
    grant = run.one(ROLE, "deployer-cluster-admin").inputs
    assert grant["principalId"] == fake_uuid("deployer", "object")
    assert grant["principalType"] == "User"
    assert grant["scope"] == run.one(CLUSTER).id
    assert grant["roleDefinitionId"].endswith(f"/roleDefinitions/{AKS_RBAC_CLUSTER_ADMIN}")


def test_the_kubernetes_provider_signs_in_with_the_azure_cli_and_holds_no_credential(
    run: ProgramRun,
) -> None:
    assert not run.calls_to("azure-native:containerservice:listManagedClusterAdminCredentials")
    provider = run.one("pulumi:providers:kubernetes")
    kubeconfig = provider.inputs["kubeconfig"]
    assert not has_credential(kubeconfig)
    (user,) = yaml.safe_load(kubeconfig)["users"]
    assert user["user"]["exec"]["command"] == "kubelogin"
    # The mocked deployer is a user signed in with az login: the cluster's tenant is kept.
    assert user["user"]["exec"]["args"] == [
        "get-token",
        "--server-id",
        AKS_SERVER_ID,
        "--login",
        "azurecli",
        "--tenant-id",
        TENANT_ID,
    ]


def test_the_conversion_keeps_the_clusters_tenant_and_drops_the_device_code_client() -> None:
    # Azure/kubelogin pkg/internal/converter/convert.go, login method azurecli, drops the tenant
    # unless --tenant-id is given; a user whose default az tenant is another would get 401.
    converted = yaml.safe_load(deployer_kubeconfig(fake_kubeconfig("c", "exec"), AS_USER, "User"))
    plugin = converted["users"][0]["user"]["exec"]
    assert plugin["apiVersion"] == "client.authentication.k8s.io/v1beta1"
    assert plugin["args"][plugin["args"].index("--tenant-id") + 1] == TENANT_ID
    assert "--client-id" not in plugin["args"]  # the device-code client is not the deployer
    assert plugin["installHint"] == "kubelogin is not installed"  # kept, as kubelogin does
    assert converted["clusters"] == yaml.safe_load(fake_kubeconfig("c", "exec"))["clusters"]


def test_a_kubeconfig_with_a_credential_is_refused() -> None:
    # A token (or certificate) instead of the plugin: not an Entra ID cluster.
    with pytest.raises(ValueError, match="does not sign in through kubelogin"):
        deployer_kubeconfig(fake_kubeconfig("c"), AS_USER, "User")
    assert has_credential(fake_kubeconfig("c"))


def test_the_api_server_can_be_limited_to_listed_addresses() -> None:
    limited = run_program(
        "dev", overrides={"apiServerAuthorizedIpRanges": "203.0.113.7/32, 198.51.100.0/24"}
    )
    profile = limited.one(CLUSTER).inputs["apiServerAccessProfile"]
    assert profile == {"authorizedIPRanges": ["203.0.113.7/32", "198.51.100.0/24"]}


@pytest.mark.parametrize(
    "value", ["203.0.113.7", "10.0.0.1/33", "2001:db8::/32", "198.51.100.1/24"]
)
def test_a_bad_range_names_the_key_and_the_form(value: str) -> None:
    cfg = load({"apiServerAuthorizedIpRanges": f"203.0.113.7/32,{value}"}, "spot-lab", "dev")
    with pytest.raises(
        ConfigError, match="apiServerAuthorizedIpRanges must be comma-separated"
    ) as info:
        validate(cfg)
    assert len(info.value.problems) == 1 and repr(value) in info.value.problems[0]


def test_the_kubernetes_provider_waits_until_the_role_applies(run: ProgramRun) -> None:
    # The role existing is not enough: AKS documents up to five minutes before the API server
    # honours it. The provider (and so every object) waits for the command that asks it.
    provider = run.one("pulumi:providers:kubernetes")
    grant = run.one(ROLE, "deployer-cluster-admin")
    wait = run.one("command:local:Command", "admin-access")
    assert wait.urn in provider.dependencies
    assert grant.urn in wait.dependencies
    assert run.waits_for(provider, grant)
