"""What the cluster autoscaler says about GPU capacity, each event as one line: no Spot capacity,
falling back to on-demand, back on Spot.

The events and their wording, from kubernetes/autoscaler's ``cluster-autoscaler`` source:

- on the pending pod (``processors/status/eventing_scale_up_processor.go``):
  ``TriggeredScaleUp`` "pod triggered scale-up: [{<group> <current>-><new> (max: <max>)}]"
  (``processors/nodegroupset``, ``ScaleUpInfo.String``), and ``NotTriggerScaleUp`` "pod didn't
  trigger scale-up: <count> <reason>, ..." with reasons such as "in backoff after failed
  scale-up" and "max node group size reached" (``core/scaleup/orchestrator/skippedreasons.go``);
- on ``kube-system/cluster-autoscaler-status`` (its ``LogEventRecorder``,
  ``clusterstate/utils/status.go``): ``FailedToScaleUpGroup`` "Scale-up failed for group
  <group>: <the cloud's error>" (``core/scaleup/orchestrator/executor.go``), ``ScaleUpFailed``
  "Failed adding <n> nodes to group <group> due to <class>.<code>; source errors: ..." and
  ``ScaleUpTimedOut`` "Nodes added to group <group> failed to register within <duration>"
  (``clusterstate/clusterstate.go``). On AKS a node that fails to provision, a Spot allocation
  failure among them, is ``OutOfResource.provisioning-state-failed``, "Azure failed to provision
  a node for this node group" (``cloudprovider/azure/azure_scale_set.go``), and an ARM refusal
  names its code (``AllocationFailed``, ``SkuNotAvailable``, ...).

``FailedScaleUp`` is read as well: it is the reason other autoscaler builds give a pod whose
scale-up failed (GKE's: "Node scale up in zones ... associated with this pod failed").

A worker that cannot fit is said too, once per pod and cause. The scheduler's ``FailedScheduling``
counts the nodes per reason ("0/6 nodes are available: 3 Insufficient nvidia.com/gpu, 4
Insufficient cpu. preemption: ...", ``pkg/scheduler`` ``FitError.Error``; the reasons from
``noderesources/fit.go``): more nodes short of CPU or memory than of GPUs means a node with its
GPU free lacks the rest. The autoscaler's ``NotTriggerScaleUp`` with "Insufficient cpu" means its
simulated new node would not fit the pod either (the scheduler's predicates on the group's node
template). Either way the worker would stay Pending for good.

A group is a pool's scale set, ``aks-<pool>-<digits>-vmss``; the pool's name says whether it is
the Spot pool or the on-demand fallback (``catalog/gpu_pools.py``).
"""

from __future__ import annotations

import re

from catalog.gpu_pools import ON_DEMAND, SPOT, node_kind, pool_kind, scale_set_pools
from lab.report.run_logs import ClusterEvent

FAILED_SCALE_UP = ("ScaleUpFailed", "FailedToScaleUpGroup", "ScaleUpTimedOut", "FailedScaleUp")
BACKOFF = "in backoff after failed scale-up"
_CODE = re.compile(
    r"\b(SkuNotAvailable|AllocationFailed|ZonalAllocationFailed|Overconstrained\w*Request"
    r"|QuotaExceeded|OperationNotAllowed|OutOfResource\.[\w-]+)\b"
)
_SCALE_UP = re.compile(r"\{aks-(?P<pool>[a-z][a-z0-9]*)-\d+-vmss (?P<sizes>\d+->\d+) \(max: \d+\)")
_TIMEOUT = re.compile(r"failed to register within (\S+)")
_INSUFFICIENT = re.compile(r"\b(\d+) Insufficient ([\w./-]+)")
FIT_RESOURCES = ("cpu", "memory")
GPU = "nvidia.com/gpu"
FIX = "set workerCpu and workerMemory lower (docs/azure.md)"


def shortages(message: str) -> dict[str, int]:
    """How many nodes lack each resource, from a scheduler's or autoscaler's message (without
    the preemption's own summary)."""
    counts: dict[str, int] = {}
    for count, resource in _INSUFFICIENT.findall(message.split(". preemption:", 1)[0]):
        counts[resource] = counts.get(resource, 0) + int(count)
    return counts


def _requests(resources: list[str]) -> str:
    return f"its {' and '.join(resources)} request" + (" is" if len(resources) == 1 else "s are")


def _why(reason: str, message: str) -> str:
    """The cloud's own code, or what the autoscaler saw, in a few words."""
    found = _CODE.search(message)
    if found and found[1] in ("QuotaExceeded", "OperationNotAllowed"):
        return f"{found[1]}: out of quota"
    if found:
        return found[1]
    timed_out = _TIMEOUT.search(message)
    if timed_out:
        return f"no node registered within {timed_out[1]}"
    return " ".join(message.split())[:80] or reason


class CapacityLines:
    """Turns autoscaler events into lines; remembers a fallback so it can say "back on Spot"."""

    def __init__(self) -> None:
        self.on_demand_seen = False
        """A scale-up of the on-demand pool was seen, and no Spot node since."""
        self.unfit_said: set[str] = set()
        """Lines about a worker that cannot fit, said once each."""

    def line(self, event: ClusterEvent) -> str | None:
        """The one line for a capacity event; None for every other event."""
        if event.reason in FAILED_SCALE_UP:
            return self._failed(event)
        if event.reason == "NotTriggerScaleUp" and BACKOFF in event.message:
            return (
                f"no Spot capacity: {event.name} waits for a GPU node; the autoscaler backs off "
                f"a pool after a failed scale-up ({event.message.split(': ', 1)[-1]})"
            )
        if event.reason in ("FailedScheduling", "NotTriggerScaleUp"):
            return self._unfit(event)
        if event.reason == "TriggeredScaleUp":
            return self._scale_up(event)
        if event.reason in ("RegisteredNode", "Scheduled"):
            return self._arrived(event)
        return None

    def _failed(self, event: ClusterEvent) -> str:
        pools = scale_set_pools(event.message)
        pool = pools[0] if pools else None
        kind = pool_kind(pool) if pool else None
        why = _why(event.reason, event.message)
        if kind == ON_DEMAND:
            return f"no on-demand capacity either: pool {pool} could not add a node ({why})"
        if kind == SPOT:
            return f"no Spot capacity: pool {pool} could not add a node ({why})"
        where = f"pool {pool}" if pool else event.name
        return f"scale-up failed for {where} ({event.reason}: {why})"

    def _unfit(self, event: ClusterEvent) -> str | None:
        counts = shortages(event.message)
        if event.reason == "FailedScheduling":
            gpus = counts.get(GPU, 0)
            lacking = [r for r in FIT_RESOURCES if counts.get(r, 0) > gpus]
            short = ", ".join(f"{counts[r]} nodes short of {r}" for r in lacking)
            line = (
                f"{event.name} cannot fit a node with a free GPU: {_requests(lacking)} more than "
                f"the node has allocatable ({short}, {gpus} of {GPU}); {FIX}"
            )
        else:
            lacking = [r for r in FIT_RESOURCES if r in counts]
            line = (
                f"{event.name} cannot fit a new GPU node either: the autoscaler finds "
                f"{_requests(lacking)} more than a new node has allocatable; {FIX}"
            )
        if not lacking or line in self.unfit_said:
            return None
        self.unfit_said.add(line)
        return line

    def _scale_up(self, event: ClusterEvent) -> str | None:
        for found in _SCALE_UP.finditer(event.message):
            if pool_kind(found["pool"]) == ON_DEMAND:
                self.on_demand_seen = True
                return (
                    f"falling back to on-demand: {event.name} scales pool {found['pool']} "
                    f"{found['sizes']}"
                )
        return None

    def _arrived(self, event: ClusterEvent) -> str | None:
        node = event.name if event.kind == "Node" else event.message.rsplit(" to ", 1)[-1].strip()
        if not self.on_demand_seen or node_kind(node) != SPOT:
            return None
        self.on_demand_seen = False
        who = "node" if event.kind == "Node" else f"{event.name} on"
        return f"back on Spot: {who} {node}"
