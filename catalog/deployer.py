"""Who runs ``pulumi up``: how pulumi-azure-native signs in, and how kubelogin signs in as the same.

The deployer gets the cluster-admin role (and a write role on ``data``) through
``getClientConfig``'s object id, which is whoever azure-native signed in as. The Kubernetes
provider, the wait for that role and ``lab watch`` reach the cluster through kubelogin, so
kubelogin must sign in as that same identity, or every Kubernetes call is Forbidden. The rules
follow azure-native's own precedence (the provider's ``clientId``/``clientSecret``/
``clientCertificatePath``/``useMsi``/``useOidc`` settings, or their ``ARM_*`` variables):

- a client id with a secret or a certificate: that service principal. kubelogin
  ``--login spn`` with its client and tenant id reads the secret from ``AZURE_CLIENT_SECRET``
  (or the certificate from ``AZURE_CLIENT_CERTIFICATE_PATH``), never from the kubeconfig
  (Azure/kubelogin ``get-token`` flags);
- ``useMsi``: the managed identity (the user-assigned one when a client id is set); kubelogin
  ``--login msi``;
- otherwise the Azure CLI's login, which may be a user, a service principal
  (``az login --service-principal``) or a managed identity (``az login --identity``). Which one
  only ``getClientConfig`` tells: its client id is the Azure CLI's own application id when a
  user signed in, and the principal's own when not. kubelogin ``--login azurecli`` keeps the
  cluster's tenant for a user, whose default tenant may be another; not for a principal, which
  ``az`` signs into one tenant only and which for a managed identity refuses a tenant
  (Azure/kubelogin ``pkg/internal/converter/convert.go`` and its issue 123).

ARM refuses a role assignment whose ``principalType`` does not match the principal, so the
type comes from the same decision. OIDC sign-in has no kubelogin counterpart for a CI runner
and is refused with the way out. Pure: imports nothing of ours; ``lab preflight`` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

AZURE_CLI_APP_ID = "04b07795-8ddb-461a-bbee-02f9e1bf7b46"
"""The Azure CLI's first-party application id: the client id of a user's ``az login`` token."""
USER = "User"
SERVICE_PRINCIPAL = "ServicePrincipal"

SERVICE_PRINCIPAL_LOGIN = "service-principal"
MANAGED_IDENTITY_LOGIN = "managed-identity"
AZURE_CLI_LOGIN = "azure-cli"


def _setting(config: Mapping[str, str], key: str, env: Mapping[str, str], var: str) -> str:
    """An azure-native setting: the provider config wins over its ``ARM_*`` variable."""
    return (config.get(key) or env.get(var) or "").strip()


def _true(value: str) -> bool:
    return value.lower() in ("true", "1", "yes")


@dataclass(frozen=True)
class DeployerSignIn:
    """How ``pulumi up`` signs in to Azure, and so who becomes the cluster's admin."""

    login: str
    """``service-principal``, ``managed-identity`` or ``azure-cli``."""
    client_id: str = ""
    """The service principal's or the user-assigned identity's client id."""
    tenant_id: str = ""
    """``ARM_TENANT_ID`` / ``azure-native:tenantId`` when set."""
    certificate: bool = False
    """A service principal that signs in with a certificate rather than a secret."""

    def principal_type(self, client_config_client_id: str) -> str:
        """``User`` or ``ServicePrincipal``, given ``getClientConfig``'s client id."""
        if self.login != AZURE_CLI_LOGIN:
            return SERVICE_PRINCIPAL
        return USER if client_config_client_id.lower() == AZURE_CLI_APP_ID else SERVICE_PRINCIPAL

    def login_flags(self, tenant_id: str, principal_type: str) -> list[str]:
        """The kubelogin flags that sign in as this identity (``get-token`` and
        ``convert-kubeconfig`` take the same ones)."""
        if self.login == SERVICE_PRINCIPAL_LOGIN:
            return ["--login", "spn", "--client-id", self.client_id, "--tenant-id", tenant_id]
        if self.login == MANAGED_IDENTITY_LOGIN:
            return ["--login", "msi", *(["--client-id", self.client_id] if self.client_id else [])]
        if principal_type == USER:
            return ["--login", "azurecli", "--tenant-id", tenant_id]
        return ["--login", "azurecli"]

    def kubelogin_args(self, server_id: str, tenant_id: str, principal_type: str) -> list[str]:
        """``kubelogin get-token`` arguments that sign in as this identity."""
        return ["get-token", "--server-id", server_id, *self.login_flags(tenant_id, principal_type)]

    def describe(self) -> str:
        """How the deployer signs in, in words (``lab preflight`` prints it)."""
        if self.login == SERVICE_PRINCIPAL_LOGIN:
            how = "a certificate" if self.certificate else "a secret"
            return f"service principal {self.client_id} (ARM_CLIENT_ID with {how})"
        if self.login == MANAGED_IDENTITY_LOGIN:
            which = f"user-assigned {self.client_id}" if self.client_id else "system-assigned"
            return f"managed identity, {which} (ARM_USE_MSI)"
        return "the Azure CLI's login (az login: a user, or a principal after --service-principal)"

    def kubelogin_needs(self) -> str:
        """What kubelogin needs in the environment besides the kubeconfig ("" for nothing)."""
        if self.login != SERVICE_PRINCIPAL_LOGIN:
            return ""
        if self.certificate:
            return "AZURE_CLIENT_CERTIFICATE_PATH (the certificate of ARM_CLIENT_CERTIFICATE_PATH)"
        return "AZURE_CLIENT_SECRET (the same secret as ARM_CLIENT_SECRET)"


def deployer_sign_in(env: Mapping[str, str], config: Mapping[str, str]) -> DeployerSignIn:
    """How azure-native signs in, from its ``azure-native:*`` config (without the namespace)
    and the ``ARM_*`` environment. ValueError for OIDC, which kubelogin cannot mirror here."""
    client_id = _setting(config, "clientId", env, "ARM_CLIENT_ID")
    tenant_id = _setting(config, "tenantId", env, "ARM_TENANT_ID")
    secret = _setting(config, "clientSecret", env, "ARM_CLIENT_SECRET")
    certificate = _setting(config, "clientCertificatePath", env, "ARM_CLIENT_CERTIFICATE_PATH")
    if client_id and (secret or certificate):
        return DeployerSignIn(SERVICE_PRINCIPAL_LOGIN, client_id, tenant_id, bool(certificate))
    if _true(_setting(config, "useMsi", env, "ARM_USE_MSI")):
        return DeployerSignIn(MANAGED_IDENTITY_LOGIN, client_id, tenant_id)
    if _true(_setting(config, "useOidc", env, "ARM_USE_OIDC")):
        raise ValueError(
            "azure-native:useOidc (ARM_USE_OIDC) signs in with a federated token that kubelogin "
            "cannot use to reach the cluster as the same identity. Sign in with "
            "`az login --service-principal --username <client id> --tenant <tenant id> "
            "--federated-token <token>` and unset ARM_USE_OIDC (pulumi up then uses the Azure "
            "CLI's login), or use a client secret or certificate"
        )
    return DeployerSignIn(AZURE_CLI_LOGIN, tenant_id=tenant_id)
