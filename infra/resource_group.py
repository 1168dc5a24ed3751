"""Where the lab lives: its resource group, and the subscription the deployment runs in."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_azure_native as azure_native


@dataclass
class LabResourceGroupArgs:
    """Inputs of ``LabResourceGroup``."""

    resource_group_name: str
    """Physical name of the resource group."""
    location: str
    """Azure region of the resource group (and of the lab)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags on every Azure resource."""
    retain_on_delete: bool = False
    """Keep the group on ``pulumi destroy`` (``retainCheckpoints``): deleting a resource group
    deletes everything in it, the storage account kept for its checkpoints too."""


class LabResourceGroup(pulumi.ComponentResource):
    """The resource group every Azure resource of the lab goes into.

    It also reports the subscription the provider deploys into: the storage account and
    registry names hash it, so they are unique per deployment (ARM's ``uniqueString`` idea).
    """

    name: pulumi.Output[str]
    resource_group_id: pulumi.Output[str]
    subscription_id: pulumi.Output[str]
    deployer_object_id: pulumi.Output[str]
    deployer_client_id: pulumi.Output[str]
    tenant_id: pulumi.Output[str]
    """The Entra ID tenant the deployer signed in to: the cluster's (AKS-managed Entra ID)."""
    """The deployer's token's client id: the Azure CLI's own app id for a user
    (``catalog/deployer.py``)."""

    def __init__(
        self, name: str, args: LabResourceGroupArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:resources:LabResourceGroup", name, None, opts)
        group = azure_native.resources.ResourceGroup(
            f"{name}-rg",
            resource_group_name=args.resource_group_name,
            location=args.location,
            tags=args.tags,
            opts=pulumi.ResourceOptions(
                parent=self,
                # It was the top-level "lab" before this component existed: without the
                # alias, an existing stack would replace the group and everything in it.
                aliases=[pulumi.Alias(name="lab", parent=pulumi.ROOT_STACK_RESOURCE)],
                # pulumi-azure-native deletes a group with whatever it holds (its issue #2522).
                retain_on_delete=args.retain_on_delete,
            ),
        )
        client = azure_native.authorization.get_client_config_output(
            opts=pulumi.InvokeOutputOptions(parent=self)
        )
        self.name = group.name
        self.resource_group_id = group.id
        self.subscription_id = client.subscription_id
        # Who runs `pulumi up`: the user (or CI principal) gets the roles a user needs.
        self.deployer_object_id = client.object_id
        self.deployer_client_id = client.client_id
        self.tenant_id = client.tenant_id
        self.register_outputs(
            {
                "name": self.name,
                "resource_group_id": self.resource_group_id,
                "subscription_id": self.subscription_id,
                "deployer_object_id": self.deployer_object_id,
                "deployer_client_id": self.deployer_client_id,
                "tenant_id": self.tenant_id,
            }
        )
