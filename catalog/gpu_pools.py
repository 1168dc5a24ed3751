"""The GPU pools' names, and how AKS and its cluster autoscaler name what they make of them.

The Spot pool is ``gpu`` plus a hash of its create-only settings; the optional on-demand
fallback pool of the same size is ``ond`` plus a hash (``infra/node_pools.py``). AKS backs each
pool with a VM scale set named ``aks-<pool>-<digits>-vmss`` (kubernetes/autoscaler PR 1896,
``cloudprovider/azure/README.md``: "The vm scale set names will be aks-<nodepool>-<hash>-vmss")
and names its nodes after it, ``aks-<pool>-<digits>-vmss<6 base-36 digits>``. The cluster
autoscaler's node group id on AKS is that scale set's name (``cloudprovider/azure/
azure_scale_set.go``: ``func (scaleSet *ScaleSet) Id() string { return scaleSet.Name }``), so
the priority expander's regexes, the autoscaler's events and the report all read a pool's kind
from these names. Pure: imports nothing of ours.
"""

from __future__ import annotations

import re

SPOT_PREFIX = "gpu"
"""The GPU Spot pool's name prefix."""
ON_DEMAND_PREFIX = "ond"
"""The on-demand fallback pool's name prefix (same GPU size, regular priority)."""
NAME_HASH = 8
"""Hex digits of the settings' hash after the prefix: Linux pool names have at most 12
characters."""
SPOT, ON_DEMAND = "spot", "on-demand"
MAX_GPU_NODES = 100
"""Most GPU nodes the lab's pools may have together (the Spot pool's ceiling plus the on-demand
one's): the cluster autoscaler's ``ok-total-unready-count`` is set to it, so no eviction wave of
the lab's own nodes halts the autoscaler, and a new ceiling changes no cluster setting."""

_POOL = r"[a-z][a-z0-9]*"
SCALE_SET = re.compile(rf"aks-(?P<pool>{_POOL})-(?P<digits>\d+)-vmss")
"""A pool's scale set (the autoscaler's node group id), anywhere in a text."""
NODE = re.compile(rf"^aks-(?P<pool>{_POOL})-(?P<digits>\d+)-vmss(?P<suffix>[0-9a-z]{{6}})$")
"""A node of a pool."""


def pool_kind(pool: str) -> str | None:
    """``spot`` or ``on-demand`` for one of our GPU pools' names; None for any other pool."""
    for prefix, kind in ((SPOT_PREFIX, SPOT), (ON_DEMAND_PREFIX, ON_DEMAND)):
        if re.fullmatch(rf"{prefix}[0-9a-f]{{{NAME_HASH}}}", pool):
            return kind
    return None


def node_pool(node: str) -> str | None:
    """The pool a node belongs to, from its name (None: not an AKS scale-set node)."""
    match = NODE.match(node)
    return match["pool"] if match else None


def node_kind(node: str) -> str | None:
    """``spot`` or ``on-demand`` for a node of one of our GPU pools, from its name."""
    pool = node_pool(node)
    return pool_kind(pool) if pool else None


def scale_set_pools(text: str) -> list[str]:
    """The pools whose scale sets a text names, in order (an autoscaler event's message)."""
    return [match["pool"] for match in SCALE_SET.finditer(text)]


def scale_set_pattern(prefix: str) -> str:
    """A regex matching every generation's scale set of the pools named ``prefix`` + hash: what
    the priority expander matches node group ids against (Go's RE2, unanchored search,
    ``expander/priority/priority.go``, ``groupIDMatchesList``; anchored here)."""
    return rf"^aks-{prefix}[0-9a-f]{{{NAME_HASH}}}-[0-9]+-vmss$"
