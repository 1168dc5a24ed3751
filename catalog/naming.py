"""Physical names of the Azure resources, derived once from project, stack and name prefix.

Names inside the subscription (resource group, cluster, identity) are the name prefix plus
a slug of the stack name. Azure limits their length, and the AKS cluster name doubles as
its DNS prefix and goes into the node resource group's name, so ``name_limits`` lists the
limits and ``stack_config.validate()`` checks them before anything is registered: a name
is never cut short into a clash or a trailing '-'.

Storage account and registry names are global DNS names, so they end in a short hash of the
Azure subscription id with project/stack/prefix, like ARM's ``uniqueString``: two stacks, or
two people deploying the same defaults into their own subscriptions, never collide, and the
same stack in the same subscription keeps its names across runs. The subscription id is
only known at deployment time (an invoke), so these names reach the components as Outputs.
Pure: imports nothing of ours.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Protocol

# Storage accounts: 3-24 lowercase alphanumerics. Registries: 5-50 alphanumerics.
STORAGE_ACCOUNT_NAME = re.compile(r"^[a-z0-9]{3,24}$")
REGISTRY_NAME = re.compile(r"^[a-zA-Z0-9]{5,50}$")
RESOURCE_GROUP_MAX = 90
# The cluster name is also its DNS prefix, which AKS caps at 54 (the name alone at 63).
DNS_PREFIX_MAX = 54
# AKS names the node resource group MC_<resource group>_<cluster>_<region> and refuses a
# cluster whose node resource group name would be longer than this.
NODE_RESOURCE_GROUP_MAX = 80


class Stack(Protocol):
    """What the names follow from: the stack's config (``stack_config.LabConfig``) has it."""

    @property
    def project(self) -> str: ...
    @property
    def stack(self) -> str: ...
    @property
    def name_prefix(self) -> str: ...


@dataclass(frozen=True)
class LabNames:
    """The physical names that follow from the config alone."""

    resource_group: str
    cluster: str
    training_identity: str
    stager_identity: str
    image_repository: str = "spot-lab-trainer"
    """Repository of the training image inside the registry."""
    stager_image_repository: str = "spot-lab-stager"
    """Repository of the data-staging Job's image inside the registry."""
    task_image_repository: str = "spot-lab-task"
    """Repository of the task image (the training image plus the user's task package)."""


@dataclass(frozen=True)
class GlobalNames:
    """Names that must be unique across Azure, so they depend on the subscription too."""

    storage_account: str
    """3-24 lowercase alphanumerics."""
    registry: str
    """5-50 alphanumerics."""


@dataclass(frozen=True)
class NameLimit:
    """One name derived from the stack name, and the longest Azure accepts."""

    what: str
    name: str
    limit: int

    @property
    def too_long(self) -> bool:
        """Whether Azure would refuse the name."""
        return len(self.name) > self.limit


def unique_suffix(
    subscription_id: str, project: str, stack: str, prefix: str, length: int = 8
) -> str:
    """Hex prefix of sha256("subscription/project/stack/prefix"): distinct per deployment.

    Without the subscription, everyone deploying the defaults would get the same storage
    account and registry names and all but the first would fail with "name already taken".
    """
    if not subscription_id:
        raise ValueError("subscription_id must not be empty: it makes the global names unique")
    seed = f"{subscription_id.lower()}/{project}/{stack}/{prefix}"
    return hashlib.sha256(seed.encode()).hexdigest()[:length]


def stack_slug(stack: str) -> str:
    """The stack name as it appears in resource names: lowercase letters, digits and '-'."""
    # Stack names may hold '.', '_' and capitals; AKS and resource group names keep it simple.
    slug = re.sub(r"[^a-z0-9-]+", "-", stack.lower()).strip("-")
    return slug or "stack"


def resource_group_name(prefix: str, stack: str) -> str:
    """The lab's resource group."""
    return f"{prefix}-{stack_slug(stack)}-rg"


def cluster_name(prefix: str, stack: str) -> str:
    """The AKS cluster, also its DNS prefix."""
    return f"{prefix}-{stack_slug(stack)}-aks"


def node_resource_group_name(prefix: str, stack: str, location: str) -> str:
    """The resource group AKS creates for the nodes (its default name)."""
    return f"MC_{resource_group_name(prefix, stack)}_{cluster_name(prefix, stack)}_{location}"


def name_limits(prefix: str, stack: str, location: str) -> tuple[NameLimit, ...]:
    """Each name that grows with the stack name, with Azure's length limit."""
    return (
        NameLimit("resource group", resource_group_name(prefix, stack), RESOURCE_GROUP_MAX),
        NameLimit(
            "AKS cluster name (also its DNS prefix)", cluster_name(prefix, stack), DNS_PREFIX_MAX
        ),
        NameLimit(
            "AKS node resource group",
            node_resource_group_name(prefix, stack, location),
            NODE_RESOURCE_GROUP_MAX,
        ),
    )


def longest_stack_name(prefix: str, location: str) -> int:
    """The most characters a stack name may have for every name to fit (0: none fits)."""
    return next(
        (
            n
            for n in range(RESOURCE_GROUP_MAX, 0, -1)
            if not any(limit.too_long for limit in name_limits(prefix, "a" * n, location))
        ),
        0,
    )


def lab_names(cfg: Stack) -> LabNames:
    """The names for one stack; ``validate()`` has already checked prefix and lengths."""
    return LabNames(
        resource_group=resource_group_name(cfg.name_prefix, cfg.stack),
        cluster=cluster_name(cfg.name_prefix, cfg.stack),
        training_identity=f"{cfg.name_prefix}-{stack_slug(cfg.stack)}-trainer",
        stager_identity=f"{cfg.name_prefix}-{stack_slug(cfg.stack)}-stager",
    )


def global_names(cfg: Stack, subscription_id: str) -> GlobalNames:
    """Storage account and registry names for one stack in one subscription."""
    suffix = unique_suffix(subscription_id, cfg.project, cfg.stack, cfg.name_prefix)
    names = GlobalNames(
        storage_account=f"{cfg.name_prefix}st{suffix}",
        registry=f"{cfg.name_prefix}cr{suffix}",
    )
    if not STORAGE_ACCOUNT_NAME.match(names.storage_account):
        raise ValueError(f"storage account name {names.storage_account!r} breaks Azure's rules")
    if not REGISTRY_NAME.match(names.registry):
        raise ValueError(f"registry name {names.registry!r} breaks Azure's rules")
    return names
