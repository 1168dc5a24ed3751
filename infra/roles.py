"""Azure RBAC role assignments: built-in role ids and one thin wrapper that grants a role."""

from __future__ import annotations

import pulumi
import pulumi_azure_native as azure_native

# Built-in role definition ids (the same GUID in every subscription), as Azure's built-in
# roles reference lists them. ARM refuses an assignment to an id that does not exist.
ACR_PULL = "7f951dda-4ed3-4680-a7ca-43fe172d538d"
STORAGE_BLOB_DATA_CONTRIBUTOR = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"
STORAGE_BLOB_DATA_READER = "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1"
AKS_RBAC_CLUSTER_ADMIN = "b1ff04bb-8a4e-4dc4-8eb5-8693973ce19b"
"""Azure Kubernetes Service RBAC Cluster Admin: every Kubernetes action, through Entra ID."""


def role_definition_id(scope_id: str, role: str) -> str:
    """The subscription-scoped id of a built-in role, taking the subscription from ``scope_id``."""
    parts = scope_id.split("/")
    if len(parts) < 3 or parts[1].lower() != "subscriptions" or not parts[2]:
        raise ValueError(f"scope {scope_id!r} is not an ARM id under /subscriptions/<id>")
    return f"/subscriptions/{parts[2]}/providers/Microsoft.Authorization/roleDefinitions/{role}"


def assign_role(
    name: str,
    *,
    principal_id: pulumi.Input[str],
    role: str,
    scope: pulumi.Input[str],
    parent: pulumi.Resource,
    principal_type: pulumi.Input[str] = "ServicePrincipal",
    retain_on_delete: bool = False,
) -> azure_native.authorization.RoleAssignment:
    """Grant ``role`` on ``scope`` to a managed identity, or to whoever runs ``pulumi up``
    (``principal_type`` "User" or "ServicePrincipal": ARM refuses a type that does not match,
    and pulumi-azure-native sends "User" when none is given)."""
    return azure_native.authorization.RoleAssignment(
        name,
        principal_id=principal_id,
        # For a new identity the type is required: without it ARM looks the principal up in
        # Entra ID and can fail with PrincipalNotFound while the identity still replicates.
        principal_type=principal_type,
        role_definition_id=pulumi.Output.from_input(scope).apply(
            lambda scope_id: role_definition_id(scope_id, role)
        ),
        scope=scope,
        opts=pulumi.ResourceOptions(parent=parent, retain_on_delete=retain_on_delete),
    )
