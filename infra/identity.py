"""Pod identities: user-assigned identities a ServiceAccount acts as, through workload identity.

Two pods need Azure: the training workers (they read the dataset and write checkpoints) and the
data-staging Job (it writes the dataset). Each gets its own identity, with a write role on its
own container only, and the workers a read role on the dataset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_azure_native as azure_native

from infra.roles import STORAGE_BLOB_DATA_CONTRIBUTOR, STORAGE_BLOB_DATA_READER, assign_role

# The audience AKS workload identity tokens carry; Entra ID accepts only this one.
TOKEN_AUDIENCE = "api://AzureADTokenExchange"


def service_account_subject(namespace: str, service_account: str) -> str:
    """The OIDC subject of a Kubernetes ServiceAccount's projected token."""
    return f"system:serviceaccount:{namespace}:{service_account}"


@dataclass
class WorkloadIdentityArgs:
    """Inputs of ``WorkloadIdentity``."""

    resource_group_name: pulumi.Input[str]
    """Resource group of the identity."""
    identity_name: str
    """Physical name of the user-assigned identity."""
    location: str
    """Azure region."""
    oidc_issuer_url: pulumi.Input[str]
    """The cluster's OIDC issuer; only its tokens are trusted."""
    namespace: str
    """Namespace of the ServiceAccount."""
    service_account: str
    """Name of the ServiceAccount the identity trusts."""
    writable_container_id: pulumi.Input[str]
    """ARM id of the one container this identity may write: ``checkpoints`` for the training
    pods (the "blob" backend), ``data`` for the staging Job."""
    role_name: str = "writer"
    """Suffix of the role assignment's resource name (``checkpoints-writer``, ...)."""
    readable_container_id: pulumi.Input[str] | None = None
    """ARM id of a container this identity may read: ``data`` for the training pods."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags on every Azure resource."""


class WorkloadIdentity(pulumi.ComponentResource):
    """A managed identity a ServiceAccount can act as, with write access to one container."""

    client_id: pulumi.Output[str]
    principal_id: pulumi.Output[str]

    def __init__(
        self, name: str, args: WorkloadIdentityArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        # The alias keeps an existing stack's training identity (and its client id) in place.
        aliases = pulumi.ResourceOptions(
            aliases=[pulumi.Alias(type_="spot-lab:identity:TrainingIdentity")]
        )
        opts = pulumi.ResourceOptions.merge(opts, aliases)
        super().__init__("spot-lab:identity:WorkloadIdentity", name, None, opts)
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
        grants = [(args.role_name, STORAGE_BLOB_DATA_CONTRIBUTOR, args.writable_container_id)]
        if args.readable_container_id is not None:
            grants.append(("reader", STORAGE_BLOB_DATA_READER, args.readable_container_id))
        for suffix, role, scope in grants:
            assign_role(
                f"{name}-{suffix}",
                principal_id=identity.principal_id,
                role=role,
                scope=scope,
                parent=self,
            )
        self.client_id = identity.client_id
        self.principal_id = identity.principal_id
        self.register_outputs({"client_id": self.client_id, "principal_id": self.principal_id})
