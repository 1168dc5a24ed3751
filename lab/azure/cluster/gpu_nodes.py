"""Where the job's workers run, Spot or on-demand, and which worker ``lab rebalance`` moves next.

Pure: reads the Node and Pod objects the API server lists (plain dicts), decides, and does
nothing. A GPU node's kind is its pool's label (``spot-lab/pool``: ``gpu-spot`` or
``gpu-on-demand``, ``catalog/pool_labels.py``); the job's workers select the pools of one
generation (``spot-lab/pool-generation``), so a worker moves only to a Spot node of its own
generation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from catalog.pool_labels import GENERATION_LABEL, GPU_ON_DEMAND, GPU_SPOT, POOL_LABEL


@dataclass(frozen=True)
class GpuNode:
    """A node of one of the GPU pools, as far as a move cares."""

    name: str
    spot: bool
    generation: str
    ready: bool
    """The kubelet reports Ready."""
    schedulable: bool
    """Not cordoned."""


def gpu_node(obj: dict[str, Any]) -> GpuNode | None:
    """A Node object of a GPU pool as a ``GpuNode``; None for any other node."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(POOL_LABEL) not in (GPU_SPOT, GPU_ON_DEMAND):
        return None
    conditions = (obj.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return GpuNode(
        name=str(meta.get("name", "")),
        spot=labels[POOL_LABEL] == GPU_SPOT,
        generation=str(labels.get(GENERATION_LABEL, "")),
        ready=ready,
        schedulable=not (obj.get("spec") or {}).get("unschedulable", False),
    )


def placements(pods: Iterable[dict[str, Any]]) -> dict[str, str]:
    """pod -> node of the job's worker pods that are placed and not being deleted."""
    placed = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if node and not meta.get("deletionTimestamp") and phase in ("Pending", "Running"):
            placed[str(meta.get("name"))] = str(node)
    return placed


@dataclass(frozen=True)
class Move:
    """Drain ``pod`` off on-demand ``node``: a Ready Spot node of its generation is free."""

    pod: str
    node: str
    free_spot: tuple[str, ...]


@dataclass(frozen=True)
class Stay:
    """No move now, and why."""

    reason: str
    done: bool = False
    """No worker runs on an on-demand node: nothing is left to move."""


def next_move(nodes: list[GpuNode], placed: dict[str, str]) -> Move | Stay:
    """The next worker to move from on-demand to Spot, or why none is moved."""
    by_name = {node.name: node for node in nodes}
    on_demand = sorted(
        (pod, node) for pod, node in placed.items() if node in by_name and not by_name[node].spot
    )
    if not on_demand:
        return Stay("no worker runs on an on-demand node: every worker is on Spot", done=True)
    busy = set(placed.values())
    spot = [node for node in nodes if node.spot]
    for pod, node in on_demand:
        generation = by_name[node].generation
        free = tuple(
            n.name
            for n in spot
            if n.ready and n.schedulable and n.generation == generation and n.name not in busy
        )
        if free:
            return Move(pod, node, free)
    return Stay(_why_not(spot, busy, len(on_demand)))


def _why_not(spot: list[GpuNode], busy: set[str], waiting: int) -> str:
    """Why no Spot node can take an on-demand worker, in one line."""
    workers = f"{waiting} worker{'s' if waiting > 1 else ''} on on-demand"
    if not spot:
        return f"no Spot node is Ready: the Spot pool has no node ({workers})"
    ready = [n for n in spot if n.ready]
    if not ready:
        return f"no Spot node is Ready: {len(spot)} Spot node(s), none Ready ({workers})"
    if all(n.name in busy for n in ready):
        return f"every Ready Spot node already runs a worker ({workers})"
    return f"no free Spot node of the workers' pool generation is schedulable ({workers})"
