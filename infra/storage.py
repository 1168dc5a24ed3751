"""Blob storage for the training data and the checkpoints.

The kubelet identity mounts the dataset through the Blob CSI driver (MSI auth: blobfuse2
gets the identity's token and talks to the container's data plane, no account key), so it may
read ``data`` and nothing else. Checkpoints go through the Blob API with the training pods'
own workload identity (``__main__.py`` grants it the checkpoints container): any pod on a node
can get the kubelet's token, so the kubelet must not be able to write or delete them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_azure_native as azure_native

from infra.roles import STORAGE_BLOB_DATA_READER, assign_role

DATA_CONTAINER = "data"
CHECKPOINTS_CONTAINER = "checkpoints"


def storage_account_spec(
    account_name: pulumi.Input[str], location: str, tags: dict[str, str]
) -> dict[str, Any]:
    """The ``StorageAccount`` arguments (without the resource group): private, HTTPS, TLS 1.2."""
    return {
        "account_name": account_name,
        "location": location,
        "kind": "StorageV2",
        "sku": {"name": "Standard_LRS"},
        "access_tier": "Hot",
        "enable_https_traffic_only": True,
        "minimum_tls_version": "TLS1_2",
        "allow_blob_public_access": False,
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
    blob_reader_id: pulumi.Input[str]
    """Principal (object) id of the kubelet identity, which the dataset's Blob CSI volume
    authenticates with (no account keys in the cluster): it may read the data container."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags on every Azure resource."""


class LabStorage(pulumi.ComponentResource):
    """A StorageV2 account with a ``data`` and a ``checkpoints`` container."""

    account_name: pulumi.Output[str]
    account_id: pulumi.Output[str]
    blob_endpoint: pulumi.Output[str]
    data_container: pulumi.Output[str]
    checkpoints_container: pulumi.Output[str]
    checkpoints_container_id: pulumi.Output[str]
    data_container_id: pulumi.Output[str]
    """ARM id of the checkpoints container: the scope of checkpoint writers' roles."""

    def __init__(
        self, name: str, args: LabStorageArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:storage:LabStorage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        account = azure_native.storage.StorageAccount(
            f"{name}-account",
            resource_group_name=args.resource_group_name,
            **storage_account_spec(args.account_name, args.location, args.tags),
            opts=child,
        )
        containers = {
            container: azure_native.storage.BlobContainer(
                f"{name}-{container}",
                account_name=account.name,
                resource_group_name=args.resource_group_name,
                container_name=container,
                public_access="None",
                opts=child,
            )
            for container in (DATA_CONTAINER, CHECKPOINTS_CONTAINER)
        }
        # Any pod on a node can get the kubelet's token from the node, so it gets no more
        # than the dataset's mount needs.
        assign_role(
            f"{name}-kubelet-data-reader",
            principal_id=args.blob_reader_id,
            role=STORAGE_BLOB_DATA_READER,
            scope=containers[DATA_CONTAINER].id,
            parent=self,
        )
        self.account_name = account.name
        self.account_id = account.id
        self.blob_endpoint = account.primary_endpoints.apply(lambda e: e.blob)
        self.data_container = containers[DATA_CONTAINER].name
        self.checkpoints_container = containers[CHECKPOINTS_CONTAINER].name
        self.checkpoints_container_id = containers[CHECKPOINTS_CONTAINER].id
        self.data_container_id = containers[DATA_CONTAINER].id
        self.register_outputs(
            {
                "account_name": self.account_name,
                "account_id": self.account_id,
                "blob_endpoint": self.blob_endpoint,
                "data_container": self.data_container,
                "checkpoints_container": self.checkpoints_container,
                "checkpoints_container_id": self.checkpoints_container_id,
                "data_container_id": self.data_container_id,
            }
        )
