"""Physical names of the Azure resources, derived once from project, stack and name prefix.

Storage account and registry names are global DNS names, so they end in a short, stable hash
of project/stack/prefix: two stacks (or two people) never collide, and the same stack keeps
its names across runs. Pure: no pulumi import.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from stack_config import LabConfig

# Storage accounts: 3-24 lowercase alphanumerics. Registries: 5-50 alphanumerics.
STORAGE_ACCOUNT_NAME = re.compile(r"^[a-z0-9]{3,24}$")
REGISTRY_NAME = re.compile(r"^[a-zA-Z0-9]{5,50}$")


@dataclass(frozen=True)
class LabNames:
    """Every physical name the stack uses."""

    resource_group: str
    cluster: str
    storage_account: str
    registry: str
    training_identity: str
    image_repository: str = "spot-lab-trainer"
    """Repository of the training image inside the registry."""


def stable_suffix(project: str, stack: str, prefix: str, length: int = 8) -> str:
    """Hex digest prefix of sha256("project/stack/prefix"): globally distinct, stable per stack."""
    return hashlib.sha256(f"{project}/{stack}/{prefix}".encode()).hexdigest()[:length]


def _stack_slug(stack: str) -> str:
    # Stack names may hold '.', '_' and capitals; AKS and resource group names keep it simple.
    slug = re.sub(r"[^a-z0-9-]+", "-", stack.lower()).strip("-")
    return slug or "stack"


def lab_names(cfg: LabConfig) -> LabNames:
    """The names for one stack; ``validate()`` has already checked the prefix."""
    slug = _stack_slug(cfg.stack)
    suffix = stable_suffix(cfg.project, cfg.stack, cfg.name_prefix)
    names = LabNames(
        resource_group=f"{cfg.name_prefix}-{slug}-rg",
        cluster=f"{cfg.name_prefix}-{slug}-aks"[:63],
        storage_account=f"{cfg.name_prefix}st{suffix}",
        registry=f"{cfg.name_prefix}cr{suffix}",
        training_identity=f"{cfg.name_prefix}-{slug}-trainer",
    )
    if not STORAGE_ACCOUNT_NAME.match(names.storage_account):
        raise ValueError(f"storage account name {names.storage_account!r} breaks Azure's rules")
    if not REGISTRY_NAME.match(names.registry):
        raise ValueError(f"registry name {names.registry!r} breaks Azure's rules")
    return names
