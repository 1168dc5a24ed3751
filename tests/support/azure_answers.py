"""What the mocked Azure answers: plausible resource state, ids and invoke results.

Pure data for ``tests/support/pulumi_harness.py``: the state a provider would return for each
resource the program registers, ARM-shaped ids, and the results of the functions the program
calls (its client config, the cluster's credentials and agent pools).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from infra.catalog.deployer import AZURE_CLI_APP_ID

SUBSCRIPTION_ID = "00000000-0000-0000-0000-000000000000"
TENANT_ID = "11111111-1111-1111-1111-111111111111"


def fake_uuid(*parts: str) -> str:
    """A stable UUID for a mocked principal or client id, so runs are reproducible."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(parts)))


@dataclass(frozen=True)
class AzureAnswers:
    """What the mocked Azure says about the world outside the program."""

    subscription_id: str = SUBSCRIPTION_ID
    """The subscription the mocked provider deploys into (ids and getClientConfig)."""
    deployer_client_id: str = AZURE_CLI_APP_ID
    """getClientConfig's client id: the Azure CLI's own for a user (the default), else the
    signed-in principal's."""
    live_pool_counts: Mapping[str, int] = field(default_factory=dict)
    """Agent pools the cluster already has, with their current node counts (getManagedCluster)."""


# ---- plausible provider answers -------------------------------------------------------------

# Input property that carries each Azure resource's physical name (else Pulumi auto-names it).
_AZURE_NAME_INPUTS = {
    "azure-native:resources:ResourceGroup": "resourceGroupName",
    "azure-native:containerservice:ManagedCluster": "resourceName",
    "azure-native:containerservice:AgentPool": "agentPoolName",
    "azure-native:storage:StorageAccount": "accountName",
    "azure-native:storage:BlobContainer": "containerName",
    "azure-native:containerregistry:Registry": "registryName",
    "azure-native:managedidentity:UserAssignedIdentity": "resourceName",
    "azure-native:managedidentity:FederatedIdentityCredential": (
        "federatedIdentityCredentialResourceName"
    ),
    "azure-native:authorization:RoleAssignment": "roleAssignmentName",
}


def _physical_name(type_: str, name: str, inputs: dict[str, Any]) -> str:
    key = _AZURE_NAME_INPUTS.get(type_)
    if key and inputs.get(key):
        return str(inputs[key])
    if type_ == "azure-native:authorization:RoleAssignment":
        return fake_uuid(type_, name)
    # Auto-naming appends a random suffix; a fixed one keeps runs reproducible.
    return f"{name}1a2b3c4"


def mock_state(type_: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The state a provider would return for a new resource: inputs plus computed outputs."""
    state = dict(inputs)
    if type_.startswith("azure-native:"):
        state["name"] = _physical_name(type_, name, inputs)
        state.update(_azure_outputs(type_, name, state))
    elif type_.startswith("kubernetes:") and isinstance(state.get("metadata"), dict):
        metadata = dict(state["metadata"])
        metadata.setdefault("name", f"{name}-1a2b3c4")
        metadata.setdefault("uid", fake_uuid(type_, name))
        state["metadata"] = metadata
    elif type_ == "command:local:Command":
        state.update({"stdout": "", "stderr": ""})
    return state


def _azure_outputs(type_: str, name: str, state: dict[str, Any]) -> dict[str, Any]:
    physical = state["name"]
    location = state.get("location", "westus3")
    if type_ == "azure-native:containerservice:ManagedCluster":
        rg = state.get("resourceGroupName", "rg")
        return {
            "nodeResourceGroup": state.get("nodeResourceGroup") or f"MC_{rg}_{physical}_{location}",
            "identityProfile": {
                "kubeletidentity": {
                    "clientId": fake_uuid(name, "kubelet", "client"),
                    "objectId": fake_uuid(name, "kubelet", "object"),
                }
            },
            "oidcIssuerProfile": {
                "enabled": True,
                "issuerURL": f"https://{location}.oic.prod-aks.azure.com/{TENANT_ID}/"
                f"{fake_uuid(name, 'oidc')}/",
            },
            "provisioningState": "Succeeded",
        }
    if type_ == "azure-native:storage:StorageAccount":
        return {"primaryEndpoints": {"blob": f"https://{physical}.blob.core.windows.net/"}}
    if type_ == "azure-native:containerregistry:Registry":
        return {"loginServer": f"{physical.lower()}.azurecr.io"}
    if type_ == "azure-native:managedidentity:UserAssignedIdentity":
        return {
            "clientId": fake_uuid(name, "client"),
            "principalId": fake_uuid(name, "principal"),
            "tenantId": TENANT_ID,
        }
    return {}


# Resource provider namespaces, for ARM-shaped ids.
_ARM_NAMESPACES = {
    "authorization": "Microsoft.Authorization",
    "containerregistry": "Microsoft.ContainerRegistry",
    "containerservice": "Microsoft.ContainerService",
    "managedidentity": "Microsoft.ManagedIdentity",
    "storage": "Microsoft.Storage",
}


def mock_id(
    type_: str, name: str, state: dict[str, Any], subscription_id: str = SUBSCRIPTION_ID
) -> str:
    """An ARM-shaped id for Azure resources, ``<name>-id`` for others."""
    if not type_.startswith("azure-native:"):
        return f"{name}-id"
    _, module, kind = type_.split(":")
    if kind == "ResourceGroup":
        return f"/subscriptions/{subscription_id}/resourceGroups/{state['name']}"
    rg = state.get("resourceGroupName", "rg")
    if kind == "BlobContainer":  # a child of the account's blob service, as ARM nests it
        return (
            f"/subscriptions/{subscription_id}/resourceGroups/{rg}/providers/Microsoft.Storage"
            f"/storageAccounts/{state['accountName']}/blobServices/default/containers/"
            f"{state['name']}"
        )
    if kind == "RoleAssignment":  # an extension resource: its id hangs off its scope
        return f"{state['scope']}/providers/Microsoft.Authorization/roleAssignments/{state['name']}"
    plural = kind[0].lower() + (f"{kind[1:-1]}ies" if kind.endswith("y") else f"{kind[1:]}s")
    namespace = _ARM_NAMESPACES.get(module, f"Microsoft.{module}")
    return (
        f"/subscriptions/{subscription_id}/resourceGroups/{rg}/providers/"
        f"{namespace}/{plural}/{state['name']}"
    )


# AKS's well-known Entra ID server (application) id, the same for every cluster.
AKS_SERVER_ID = "6dae42f8-4368-4678-94ff-3960e28e3630"


def fake_kubeconfig(cluster: str, fmt: str | None = None) -> str:
    """What listClusterUserCredential returns for a mocked cluster.

    ``format=exec`` on an Entra ID cluster gives the kubelogin plugin with a device-code login
    (the AKS API's ``format`` parameter); without it, a token stands in for the legacy forms.
    """
    if fmt == "exec":
        user: dict[str, Any] = {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1",
                "command": "kubelogin",
                "args": [
                    "get-token",
                    "--environment",
                    "AzurePublicCloud",
                    "--server-id",
                    AKS_SERVER_ID,
                    "--client-id",
                    "80faf920-1908-4b52-b5ef-a8e7bedfc67a",
                    "--tenant-id",
                    TENANT_ID,
                    "--login",
                    "devicecode",
                ],
                "installHint": "kubelogin is not installed",
            }
        }
    else:
        user = {"token": "mock-token"}
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster, "cluster": {"server": f"https://{cluster}.mock:443"}}],
            "users": [{"name": f"clusterUser_{cluster}", "user": user}],
            "contexts": [
                {"name": cluster, "context": {"cluster": cluster, "user": f"clusterUser_{cluster}"}}
            ],
            "current-context": cluster,
        }
    )


def mock_invoke(
    token: str, args: dict[str, Any], answers: AzureAnswers | None = None
) -> dict[str, Any]:
    """Answers for the functions (invokes) the program may call; unknown ones return ``{}``."""
    answers = answers or AzureAnswers()
    if token in (
        "azure-native:containerservice:listManagedClusterUserCredentials",
        "azure-native:containerservice:listManagedClusterAdminCredentials",
    ):
        kubeconfig = fake_kubeconfig(str(args.get("resourceName", "cluster")), args.get("format"))
        value = base64.b64encode(kubeconfig.encode()).decode()
        return {"kubeconfigs": [{"name": "clusterUser", "value": value}]}
    if token == "azure-native:authorization:getClientConfig":
        return {
            "clientId": answers.deployer_client_id,
            "objectId": fake_uuid("deployer", "object"),
            "subscriptionId": answers.subscription_id,
            "tenantId": TENANT_ID,
        }
    if token == "azure-native:containerservice:getManagedCluster":
        pools = [{"name": "bootstrap", "count": 1, "mode": "System"}]
        pools += [{"name": n, "count": c} for n, c in answers.live_pool_counts.items()]
        return {"name": args.get("resourceName"), "agentPoolProfiles": pools}
    return {}
