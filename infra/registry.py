"""The container registry the training image is pushed to and the kubelet pulls from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_azure_native as azure_native

from infra.roles import ACR_PULL, assign_role


def registry_spec(
    registry_name: pulumi.Input[str], location: str, tags: dict[str, str]
) -> dict[str, Any]:
    """The ``Registry`` arguments (without the resource group): Basic SKU, no admin user."""
    return {
        "registry_name": registry_name,
        "location": location,
        # Basic runs ACR Tasks (`az acr build`) and is the cheapest tier.
        "sku": {"name": "Basic"},
        # Pulls authenticate as the kubelet identity (AcrPull); no shared admin password.
        "admin_user_enabled": False,
        "tags": tags,
    }


@dataclass
class LabRegistryArgs:
    """Inputs of ``LabRegistry``."""

    resource_group_name: pulumi.Input[str]
    """Resource group of the registry."""
    registry_name: pulumi.Input[str]
    """Globally unique registry name (5-50 alphanumerics); an Output, since it hashes the
    subscription id."""
    location: str
    """Azure region."""
    pull_principal_id: pulumi.Input[str]
    """Principal (object) id that gets AcrPull: the cluster's kubelet identity."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags on every Azure resource."""


class LabRegistry(pulumi.ComponentResource):
    """An Azure Container Registry the cluster can pull from without credentials."""

    name: pulumi.Output[str]
    login_server: pulumi.Output[str]

    def __init__(
        self, name: str, args: LabRegistryArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:registry:LabRegistry", name, None, opts)
        registry = azure_native.containerregistry.Registry(
            f"{name}-registry",
            resource_group_name=args.resource_group_name,
            **registry_spec(args.registry_name, args.location, args.tags),
            opts=pulumi.ResourceOptions(parent=self),
        )
        assign_role(
            f"{name}-kubelet-acr-pull",
            principal_id=args.pull_principal_id,
            role=ACR_PULL,
            scope=registry.id,
            parent=self,
        )
        self.name = registry.name
        self.login_server = registry.login_server
        self.register_outputs({"name": self.name, "login_server": self.login_server})
