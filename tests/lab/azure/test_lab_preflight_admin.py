"""Who ``pulumi up`` makes the cluster's admin, as ``lab preflight`` tells it, and the lab's
sign-in by the same rule (``catalog/deployer.py``, pulumi-azure-native's precedence).

The object id is the ARM token's ``oid`` (what ``getClientConfig`` returns), the principal
type follows from its ``appid`` (the Azure CLI's own application id for a user), and kubelogin
must sign in as that identity: for a service principal it reads the secret from
``AZURE_CLIENT_SECRET`` (Azure/kubelogin ``get-token`` flags), never from the kubeconfig.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from azure.identity import AzureCliCredential, ClientSecretCredential, ManagedIdentityCredential

from lab.azure.clients import NotSignedIn, credential_from_env
from tests.support.azure_replay import FakeAzure, StaticToken
from tests.support.lab_azure_fixtures import OID, TENANT, _preflight, scratch_project

# No preflight here reaches Docker Hub: it answers from loopback.
pytestmark = pytest.mark.usefixtures("hub")

SP = "22222222-3333-4444-5555-666666666666"
SP_OID = "33333333-4444-5555-6666-777777777777"
SP_ENV = {"ARM_CLIENT_ID": SP, "ARM_CLIENT_SECRET": "s3cret", "ARM_TENANT_ID": TENANT}


def _principal(app_id: str = SP) -> StaticToken:
    """An ARM token of a service principal: no ``upn``, its own ``appid``."""
    return StaticToken({"oid": SP_OID, "tid": TENANT, "appid": app_id})


@pytest.mark.usefixtures("processes")
def test_a_user_of_az_login_is_the_admin_and_kubelogin_keeps_the_tenant(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys)
    assert code == 0
    assert checks["cluster admin"]["detail"] == (
        f"ada@example.com, User {OID}; kubelogin --login azurecli --tenant-id {TENANT}"
    )
    assert "via the Azure CLI's login" in checks["sign-in"]["detail"]


@pytest.mark.usefixtures("processes")
def test_a_service_principal_needs_its_secret_where_kubelogin_reads_it(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys, credential=_principal(), **SP_ENV)
    assert code == 1
    check = checks["cluster admin"]
    assert check["status"] == "fails"
    assert check["detail"] == (
        f"{SP}, ServicePrincipal {SP_OID}; kubelogin --login spn --client-id {SP} --tenant-id "
        f"{TENANT}; AZURE_CLIENT_SECRET is not set"
    )
    assert check["fix"].startswith("export AZURE_CLIENT_SECRET (the same secret as")
    assert f"service principal {SP} (ARM_CLIENT_ID with a secret)" in checks["sign-in"]["detail"]
    env = SP_ENV | {"AZURE_CLIENT_SECRET": "s3cret"}
    code, checks = _preflight(azure, capsys, credential=_principal(), **env)
    assert code == 0 and checks["cluster admin"]["status"] == "ok"


@pytest.mark.usefixtures("processes")
def test_a_certificate_needs_its_path_for_kubelogin(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"ARM_CLIENT_ID": SP, "ARM_CLIENT_CERTIFICATE_PATH": "/c.pem", "ARM_TENANT_ID": TENANT}
    code, checks = _preflight(azure, capsys, credential=_principal(), **env)
    assert code == 1
    assert checks["cluster admin"]["detail"].endswith("AZURE_CLIENT_CERTIFICATE_PATH is not set")


@pytest.mark.usefixtures("processes")
def test_a_principal_signed_in_to_az_is_a_service_principal_without_a_tenant_flag(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys, credential=_principal())
    assert code == 0
    assert checks["cluster admin"]["detail"] == (
        f"{SP}, ServicePrincipal {SP_OID}; kubelogin --login azurecli"
    )


@pytest.mark.usefixtures("processes")
def test_a_managed_identity_signs_in_with_msi(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"ARM_USE_MSI": "true", "ARM_CLIENT_ID": SP}
    code, checks = _preflight(azure, capsys, credential=_principal(), **env)
    assert code == 0
    assert checks["cluster admin"]["detail"].endswith(f"kubelogin --login msi --client-id {SP}")
    assert "managed identity, user-assigned" in checks["sign-in"]["detail"]


@pytest.mark.usefixtures("processes")
def test_the_stacks_own_sign_in_settings_count_like_pulumi_ups(
    azure: FakeAzure, tools: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = scratch_project(
        tmp_path, **{"azure-native:clientId": SP, "azure-native:tenantId": TENANT}
    )
    env = {"ARM_CLIENT_SECRET": "s3cret", "AZURE_CLIENT_SECRET": "s3cret"}
    code, checks = _preflight(
        azure, capsys, "--stack", "test", project=project, credential=_principal(), **env
    )
    assert code == 0
    assert "--login spn --client-id" in checks["cluster admin"]["detail"]


@pytest.mark.usefixtures("processes")
def test_a_client_id_without_a_visible_secret_warns(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys, ARM_CLIENT_ID=SP)
    assert code == 0
    check = checks["cluster admin"]
    assert check["status"] == "warning"
    assert "encrypted azure-native:clientSecret" in check["fix"]


@pytest.mark.usefixtures("processes")
def test_oidc_sign_in_is_refused_before_anything_is_asked(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys, ARM_USE_OIDC="true")
    assert code == 1
    assert checks["azure"]["detail"].startswith("azure-native:useOidc (ARM_USE_OIDC)")
    assert checks["cluster admin"]["status"] == "skipped"
    assert azure.seen == []


@pytest.mark.usefixtures("processes")
def test_a_token_that_names_no_client_only_warns(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = StaticToken({"oid": OID, "tid": TENANT, "upn": "ada@example.com"})
    code, checks = _preflight(azure, capsys, credential=token)
    assert code == 0
    assert checks["cluster admin"]["status"] == "warning"


@pytest.mark.parametrize(
    ("environ", "provider", "kind"),
    [
        (SP_ENV, {}, ClientSecretCredential),
        ({"ARM_CLIENT_SECRET": "s"}, {"clientId": SP, "tenantId": TENANT}, ClientSecretCredential),
        ({"ARM_USE_MSI": "true"}, {}, ManagedIdentityCredential),
        ({}, {}, AzureCliCredential),
        ({"ARM_CLIENT_ID": SP}, {}, AzureCliCredential),
    ],
)
def test_the_lab_signs_in_by_the_deployers_rule(
    environ: dict[str, str], provider: dict[str, str], kind: type[Any]
) -> None:
    assert isinstance(credential_from_env(environ, provider), kind)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"ARM_CLIENT_ID": SP, "ARM_CLIENT_SECRET": "s"}, "has no tenant: set ARM_TENANT_ID"),
        ({"ARM_USE_OIDC": "true"}, "kubelogin cannot use"),
    ],
)
def test_a_sign_in_the_lab_cannot_mirror_is_one_line(environ: dict[str, str], message: str) -> None:
    with pytest.raises(NotSignedIn, match=message):
        credential_from_env(environ)
