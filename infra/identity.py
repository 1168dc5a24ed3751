"""The training pods' Azure identity: a user-assigned identity trusted via workload identity."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_azure_native as azure_native

from infra.roles import STORAGE_BLOB_DATA_CONTRIBUTOR, assign_role

# The audience AKS workload identity tokens carry; Entra ID accepts only this one.
TOKEN_AUDIENCE = "api://AzureADTokenExchange"


def service_account_subject(namespace: str, service_account: str) -> str:
    """The OIDC subject of a Kubernetes ServiceAccount's projected token."""
    return f"system:serviceaccount:{namespace}:{service_account}"


@dataclass
class TrainingIdentityArgs:
    """Inputs of ``TrainingIdentity``."""

    resource_group_name: pulumi.Input[str]
    """Resource group of the identity."""
    identity_name: str
    """Physical name of the user-assigned identity."""
    location: str
    """Azure region."""
    oidc_issuer_url: pulumi.Input[str]
    """The cluster's OIDC issuer; only its tokens are trusted."""
    namespace: str
    """Namespace of the training ServiceAccount."""
    service_account: str
    """Name of the training ServiceAccount."""
    checkpoints_container_id: pulumi.Input[str]
    """ARM id of the checkpoints container: the "blob" checkpoint backend writes there with
    this identity (the dataset comes through the kubelet's read-only mount)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags on every Azure resource."""


class TrainingIdentity(pulumi.ComponentResource):
    """A managed identity the training ServiceAccount can act as, with access to checkpoints."""

    client_id: pulumi.Output[str]
    principal_id: pulumi.Output[str]

    def __init__(
        self, name: str, args: TrainingIdentityArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:identity:TrainingIdentity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        identity = azure_native.managedidentity.UserAssignedIdentity(
            f"{name}-uai",
            resource_group_name=args.resource_group_name,
            resource_name_=args.identity_name,
            location=args.location,
            tags=args.tags,
            opts=child,
        )
        azure_native.managedidentity.FederatedIdentityCredential(
            f"{name}-federation",
            resource_group_name=args.resource_group_name,
            resource_name_=identity.name,
            federated_identity_credential_resource_name=f"{args.namespace}-{args.service_account}",
            issuer=args.oidc_issuer_url,
            subject=service_account_subject(args.namespace, args.service_account),
            audiences=[TOKEN_AUDIENCE],
            opts=child,
        )
        assign_role(
            f"{name}-checkpoints-writer",
            principal_id=identity.principal_id,
            role=STORAGE_BLOB_DATA_CONTRIBUTOR,
            scope=args.checkpoints_container_id,
            parent=self,
        )
        self.client_id = identity.client_id
        self.principal_id = identity.principal_id
        self.register_outputs({"client_id": self.client_id, "principal_id": self.principal_id})
