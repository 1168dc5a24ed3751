"""Sign-in setups: the admin role goes to the identity kubelogin signs in as, with the right
principalType, and the cluster's tenant is kept where kubelogin can use it.

pulumi-azure-native grants through ``getClientConfig``'s object id, which is whoever it signed in
as; the kubeconfig must make kubelogin sign in as that same identity (``catalog/deployer.py``
has the rules and their sources). Each setup runs the whole program under the mocks with the
environment a user of that setup has, and ``getClientConfig`` answering as Azure would: the Azure
CLI's own application id for a user's ``az login``, the principal's id otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import yaml

from catalog.deployer import (
    AZURE_CLI_APP_ID,
    AZURE_CLI_LOGIN,
    MANAGED_IDENTITY_LOGIN,
    SERVICE_PRINCIPAL_LOGIN,
    DeployerSignIn,
    deployer_sign_in,
)
from tests.support.pulumi_harness import (
    AKS_SERVER_ID,
    TENANT_ID,
    AzureAnswers,
    ProgramRun,
    fake_uuid,
    run_program,
)

ROLE = "azure-native:authorization:RoleAssignment"
SP_APP_ID = "00000000-0000-0000-0000-00000000c1d0"
MI_CLIENT_ID = "00000000-0000-0000-0000-0000000000e1"
ARM_VARIABLES = (
    "ARM_CLIENT_ID",
    "ARM_CLIENT_SECRET",
    "ARM_CLIENT_CERTIFICATE_PATH",
    "ARM_TENANT_ID",
    "ARM_USE_MSI",
    "ARM_USE_OIDC",
)


@dataclass(frozen=True)
class Setup:
    """One way to sign in to Azure before ``pulumi up``."""

    env: dict[str, str]
    token_client_id: str
    """What getClientConfig answers as the client id for this sign-in."""
    principal_type: str
    kubelogin: list[str]
    """The login flags the kubeconfig must carry (after get-token --server-id <id>)."""
    config: dict[str, str] = field(default_factory=dict)


SETUPS = {
    "user with az login": Setup(
        {}, AZURE_CLI_APP_ID, "User", ["--login", "azurecli", "--tenant-id", TENANT_ID]
    ),
    # ARM_CLIENT_ID alone (no secret): azure-native still uses the Azure CLI's user, and so
    # must the grant (it used to say ServicePrincipal for the user's object id).
    "user with a stray ARM_CLIENT_ID": Setup(
        {"ARM_CLIENT_ID": SP_APP_ID},
        AZURE_CLI_APP_ID,
        "User",
        ["--login", "azurecli", "--tenant-id", TENANT_ID],
    ),
    # az login --service-principal: a principal, which az signs into one tenant only.
    "az login --service-principal": Setup(
        {}, SP_APP_ID, "ServicePrincipal", ["--login", "azurecli"]
    ),
    # az login --identity: kubelogin's azurecli mode must not pass a tenant (kubelogin #123).
    "az login --identity": Setup({}, MI_CLIENT_ID, "ServicePrincipal", ["--login", "azurecli"]),
    "service principal secret (ARM_*)": Setup(
        {"ARM_CLIENT_ID": SP_APP_ID, "ARM_CLIENT_SECRET": "x", "ARM_TENANT_ID": TENANT_ID},
        SP_APP_ID,
        "ServicePrincipal",
        ["--login", "spn", "--client-id", SP_APP_ID, "--tenant-id", TENANT_ID],
    ),
    "service principal in the stack's provider config": Setup(
        {},
        SP_APP_ID,
        "ServicePrincipal",
        ["--login", "spn", "--client-id", SP_APP_ID, "--tenant-id", TENANT_ID],
        config={"azure-native:clientId": SP_APP_ID, "azure-native:clientSecret": "x"},
    ),
    "user-assigned managed identity": Setup(
        {"ARM_USE_MSI": "true", "ARM_CLIENT_ID": MI_CLIENT_ID},
        MI_CLIENT_ID,
        "ServicePrincipal",
        ["--login", "msi", "--client-id", MI_CLIENT_ID],
    ),
    "system-assigned managed identity": Setup(
        {"ARM_USE_MSI": "true"}, fake_uuid("vm", "identity"), "ServicePrincipal", ["--login", "msi"]
    ),
}


def _run(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> ProgramRun:
    for name in ARM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in setup.env.items():
        monkeypatch.setenv(name, value)
    answers = AzureAnswers(deployer_client_id=setup.token_client_id)
    return run_program("dev", setup.config, answers=answers)


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_the_admin_is_the_identity_kubelogin_signs_in_as(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = SETUPS[name]
    run = _run(setup, monkeypatch)
    deployer = fake_uuid("deployer", "object")  # getClientConfig's object id
    for grant in ("deployer-cluster-admin", "deployer-data-writer"):
        inputs = run.one(ROLE, grant).inputs
        assert inputs["principalId"] == deployer
        # ARM refuses an assignment whose principalType does not match the principal.
        assert inputs["principalType"] == setup.principal_type, grant
    (user,) = yaml.safe_load(run.outputs["kubeconfig"])["users"]
    args = user["user"]["exec"]["args"]
    assert args == ["get-token", "--server-id", AKS_SERVER_ID, *setup.kubelogin]
    # No secret in the kubeconfig, ever: kubelogin reads it from the environment.
    assert "x" not in args and "--client-secret" not in args
    # The wait for the role and the Kubernetes provider use that same kubeconfig.
    wait = run.one("command:local:Command", "admin-access")
    assert wait.inputs["environment"]["SPOT_LAB_KUBECONFIG"] == run.outputs["kubeconfig"]
    provider = run.one("pulumi:providers:kubernetes")
    assert provider.inputs["kubeconfig"] == run.outputs["kubeconfig"]
    # The user's own kubeconfig signs in the same way.
    assert run.outputs["getCredentials"].endswith(
        "kubelogin convert-kubeconfig " + " ".join(setup.kubelogin)
    )


def test_oidc_sign_in_is_refused_before_anything_is_created(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = Setup({"ARM_USE_OIDC": "true", "ARM_CLIENT_ID": SP_APP_ID}, SP_APP_ID, "", [])
    for name in ARM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in setup.env.items():
        monkeypatch.setenv(name, value)
    run = run_program("dev", check=False)
    assert isinstance(run.error, ValueError)
    assert "azure-native:useOidc" in str(run.error) and "az login --service-principal" in str(
        run.error
    )
    assert run.resources == []


# ---- the rules, pure ----------------------------------------------------------------------------


def test_provider_config_wins_over_the_environment() -> None:
    env = {"ARM_USE_MSI": "true"}
    sign_in = deployer_sign_in(env, {"clientId": SP_APP_ID, "clientSecret": "set"})
    assert sign_in.login == SERVICE_PRINCIPAL_LOGIN and sign_in.client_id == SP_APP_ID


def test_a_certificate_is_a_service_principal_too() -> None:
    env = {"ARM_CLIENT_ID": SP_APP_ID, "ARM_CLIENT_CERTIFICATE_PATH": "/c.pfx"}
    sign_in = deployer_sign_in(env, {})
    assert (sign_in.login, sign_in.certificate) == (SERVICE_PRINCIPAL_LOGIN, True)
    assert "AZURE_CLIENT_CERTIFICATE_PATH" in sign_in.kubelogin_needs()


@pytest.mark.parametrize(
    ("env", "login", "needs"),
    [
        ({}, AZURE_CLI_LOGIN, ""),
        ({"ARM_USE_MSI": "TRUE"}, MANAGED_IDENTITY_LOGIN, ""),
        ({"ARM_CLIENT_ID": SP_APP_ID, "ARM_CLIENT_SECRET": "s"}, SERVICE_PRINCIPAL_LOGIN, "SECRET"),
    ],
)
def test_each_sign_in_says_who_and_what_kubelogin_needs(
    env: dict[str, str], login: str, needs: str
) -> None:
    sign_in = deployer_sign_in(env, {})
    assert sign_in.login == login
    assert sign_in.describe()
    assert (needs in sign_in.kubelogin_needs()) and (bool(needs) == bool(sign_in.kubelogin_needs()))


def test_the_azure_cli_app_id_means_a_user_whatever_its_case() -> None:
    cli = DeployerSignIn(AZURE_CLI_LOGIN)
    assert cli.principal_type(AZURE_CLI_APP_ID.upper()) == "User"
    assert cli.principal_type(SP_APP_ID) == "ServicePrincipal"
    assert DeployerSignIn(MANAGED_IDENTITY_LOGIN).principal_type(AZURE_CLI_APP_ID) == (
        "ServicePrincipal"
    )
