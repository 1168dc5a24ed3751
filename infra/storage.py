"""Blob storage for the training data and the checkpoints.

Entra ID only: shared-key access is off, so no account key exists that could leak or be
misused, and every reader and writer authenticates as an identity with a role on one container.
The workers (their own workload identity, ``__main__.py``) read ``data`` through the read-only
Blob CSI volume, which mounts with their own token (``workloads/manifests/volume.py``), and
write ``checkpoints`` through the Blob API; the staging Job writes ``data``; the deploying user
may write ``data`` too (``az storage blob upload-batch --auth-mode login``) and read
``checkpoints`` (``python -m lab export``). No node-wide identity (the kubelet's, whose token
any pod on a node can get) has a role here.

With ``retain_on_delete`` (``retainCheckpoints``, the default) ``pulumi destroy`` leaves the
account, its ``checkpoints`` container and the deployer's read role on it in Azure, out of the
stack (Pulumi's ``retainOnDelete``); the ``data`` container goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_azure_native as azure_native

from infra.roles import STORAGE_BLOB_DATA_CONTRIBUTOR, STORAGE_BLOB_DATA_READER, assign_role

DATA_CONTAINER = "data"
CHECKPOINTS_CONTAINER = "checkpoints"


def storage_account_spec(
    account_name: pulumi.Input[str], location: str, tags: dict[str, str]
) -> dict[str, Any]:
    """The ``StorageAccount`` arguments (without the resource group): private, HTTPS, TLS 1.2,
    Entra ID only."""
    return {
        "account_name": account_name,
        "location": location,
        "kind": "StorageV2",
        "sku": {"name": "Standard_LRS"},
        "access_tier": "Hot",
        "enable_https_traffic_only": True,
        "minimum_tls_version": "TLS1_2",
        "allow_blob_public_access": False,
        # Unset means true (StorageAccount docs in pulumi-azure-native and the REST API's
        # allowSharedKeyAccess): off, requests signed with the account key or a SAS made
        # from it are refused, and the portal uses the signed-in user's Entra ID.
        "allow_shared_key_access": False,
        "default_to_o_auth_authentication": True,
        "tags": tags,
    }


@dataclass
class LabStorageArgs:
    """Inputs of ``LabStorage``."""

    resource_group_name: pulumi.Input[str]
    """Resource group of the storage account."""
    account_name: pulumi.Input[str]
    """Globally unique storage account name (3-24 lowercase alphanumerics); an Output, since
    it hashes the subscription id."""
    location: str
    """Azure region."""
    uploader_id: pulumi.Input[str]
    """Object id of whoever runs ``pulumi up``: may write the data container, so that a user
    who stages the data by hand needs no account key."""
    uploader_type: pulumi.Input[str]
    """``User`` or ``ServicePrincipal``: what ``uploader_id`` is."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags on every Azure resource."""
    retain_on_delete: bool = False
    """Keep the account and its checkpoints on ``pulumi destroy`` (``retainCheckpoints``)."""


class LabStorage(pulumi.ComponentResource):
    """A StorageV2 account with a ``data`` and a ``checkpoints`` container."""

    account_name: pulumi.Output[str]
    account_id: pulumi.Output[str]
    blob_endpoint: pulumi.Output[str]
    data_container: pulumi.Output[str]
    checkpoints_container: pulumi.Output[str]
    checkpoints_container_id: pulumi.Output[str]
    """ARM id of the checkpoints container: the scope of checkpoint writers' roles."""
    data_container_id: pulumi.Output[str]
    """ARM id of the data container: the scope of the dataset's reader and writer roles."""
    resource_group_name: pulumi.Output[str]
    """The account's resource group (the dataset volume names it)."""

    def __init__(
        self, name: str, args: LabStorageArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:storage:LabStorage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        kept = pulumi.ResourceOptions(parent=self, retain_on_delete=args.retain_on_delete)
        account = azure_native.storage.StorageAccount(
            f"{name}-account",
            resource_group_name=args.resource_group_name,
            **storage_account_spec(args.account_name, args.location, args.tags),
            opts=kept,
        )
        containers = {
            container: azure_native.storage.BlobContainer(
                f"{name}-{container}",
                account_name=account.name,
                resource_group_name=args.resource_group_name,
                container_name=container,
                public_access="None",
                opts=kept if container == CHECKPOINTS_CONTAINER else child,
            )
            for container in (DATA_CONTAINER, CHECKPOINTS_CONTAINER)
        }
        assign_role(
            f"{name}-deployer-data-writer",
            principal_id=args.uploader_id,
            role=STORAGE_BLOB_DATA_CONTRIBUTOR,
            scope=containers[DATA_CONTAINER].id,
            parent=self,
            principal_type=args.uploader_type,
        )
        # The weights are the deployer's to take out (`lab export`), also after a destroy that
        # kept them: the role stays with the container.
        assign_role(
            f"{name}-deployer-checkpoints-reader",
            principal_id=args.uploader_id,
            role=STORAGE_BLOB_DATA_READER,
            scope=containers[CHECKPOINTS_CONTAINER].id,
            parent=self,
            principal_type=args.uploader_type,
            retain_on_delete=args.retain_on_delete,
        )
        self.account_name = account.name
        self.account_id = account.id
        self.blob_endpoint = account.primary_endpoints.apply(lambda e: e.blob)
        self.data_container = containers[DATA_CONTAINER].name
        self.checkpoints_container = containers[CHECKPOINTS_CONTAINER].name
        self.checkpoints_container_id = containers[CHECKPOINTS_CONTAINER].id
        self.data_container_id = containers[DATA_CONTAINER].id
        self.resource_group_name = pulumi.Output.from_input(args.resource_group_name)
        self.register_outputs(
            {
                "account_name": self.account_name,
                "account_id": self.account_id,
                "blob_endpoint": self.blob_endpoint,
                "data_container": self.data_container,
                "checkpoints_container": self.checkpoints_container,
                "checkpoints_container_id": self.checkpoints_container_id,
                "data_container_id": self.data_container_id,
                "resource_group_name": self.resource_group_name,
            }
        )
