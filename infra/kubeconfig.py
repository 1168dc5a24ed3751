"""The cluster's kubeconfig: Entra ID sign-in through kubelogin, as the deployer, no secret.

The cluster has local accounts disabled, so there is no admin certificate to fetch. The user
credential in exec format (``listClusterUserCredential`` with ``format=exec``) names the
``kubelogin`` plugin with a device-code login, the cluster's ``--server-id`` and its
``--tenant-id``. Here every user becomes a non-interactive ``kubelogin get-token`` that signs
in as the identity ``pulumi up`` deployed as (``catalog/deployer.py``): that identity
holds the cluster-admin role. The cluster's tenant is kept where kubelogin can use it: a user whose
default ``az`` tenant is another one would otherwise get 401 (Azure/kubelogin
``pkg/internal/converter/convert.go`` drops it when converting to ``azurecli``).

Why kubelogin rather than a token from azure-identity: the kubeconfig then holds no token, so
nothing that expires or leaks sits in the Pulumi state; and a later ``pulumi destroy`` or
``refresh`` signs in again, where a token stored at ``pulumi up`` would have expired within
the hour.
"""

from __future__ import annotations

from typing import Any

import yaml

from catalog.deployer import DeployerSignIn

EXEC_API_VERSION = "client.authentication.k8s.io/v1beta1"
INSTALL_HINT = (
    "kubelogin signs in to Entra ID for the cluster: install it with `az aks install-cli`"
)
# Fields that would carry a credential; none may survive the conversion.
_CREDENTIAL_FIELDS = ("client-certificate-data", "client-key-data", "token", "password")


def deployer_kubeconfig(text: str, sign_in: DeployerSignIn, principal_type: str) -> str:
    """The kubeconfig with every kubelogin user signing in as the deployer.

    ValueError when a user has no kubelogin exec plugin or no ``--server-id``: the cluster
    is then not an Entra ID cluster, and a kubeconfig with a credential in it is refused.
    """
    config: dict[str, Any] = yaml.safe_load(text)
    users = config.get("users") or []
    if not users:
        raise ValueError("the cluster's kubeconfig names no user")
    for entry in users:
        user = entry.get("user") or {}
        plugin = user.get("exec") or {}
        if "kubelogin" not in str(plugin.get("command", "")).lower():
            raise ValueError(
                f"kubeconfig user {entry.get('name')!r} does not sign in through kubelogin: "
                "the cluster must use Entra ID (aadProfile.managed) with local accounts disabled"
            )
        args = plugin.get("args") or []
        server_id = _arg_after(args, "--server-id")
        if not server_id:
            raise ValueError(f"kubeconfig user {entry.get('name')!r} has no --server-id")
        tenant_id = _arg_after(args, "--tenant-id") or sign_in.tenant_id
        if not tenant_id:
            raise ValueError(f"kubeconfig user {entry.get('name')!r} has no --tenant-id")
        entry["user"] = {
            "exec": {
                "apiVersion": EXEC_API_VERSION,
                "command": "kubelogin",
                "args": sign_in.kubelogin_args(server_id, tenant_id, principal_type),
                "installHint": plugin.get("installHint") or INSTALL_HINT,
                "provideClusterInfo": False,
            }
        }
    return yaml.safe_dump(config, sort_keys=False)


def has_credential(text: str) -> bool:
    """Whether any user of the kubeconfig carries a certificate, key, token or password."""
    config = yaml.safe_load(text) or {}
    return any(
        field in (entry.get("user") or {})
        for entry in config.get("users") or []
        for field in _CREDENTIAL_FIELDS
    )


def _arg_after(args: list[str], flag: str) -> str:
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return str(args[i + 1])
    return ""
