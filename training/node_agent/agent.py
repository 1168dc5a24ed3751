"""The node agent's loop: one Scheduled Events document a second, and what it calls for.

- A ``Preempt`` of this node's VM: delete the node's worker pods gracefully, then cordon the node
  (once per event). AKS's own node auto-drain does the same on the same notice, "a best effort
  service" (AKS, "Node auto-drain"); Azure/AKS #3528 shows it missing it.
- A ``Preempt`` of any VM of the placement group (this one too) whose ``NotBefore`` has passed:
  force-delete the worker pods still bound to that VM's node (once per event).
- Every ``ORPHANS_EVERY`` polls: force-delete worker pods bound to a Node that no longer exists
  (the cloud node manager deletes the Node of a VM that is gone), sooner than the pod garbage
  collector, which checks every 20 s and waits 40 s for a missing Node to show up
  (kubernetes ``pkg/controller/podgc/gc_controller.go``: ``gcCheckPeriod``,
  ``quarantineTime``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from training.elastic.exit_codes import BAD_INPUT
from training.node_agent.cluster import Cluster
from training.node_agent.scheduled_events import (
    FIRST_CALL_TIMEOUT_S,
    METADATA_URL,
    fetch,
    own_preempt,
    parse,
    started_preempts,
)

LOG = logging.getLogger("node-agent")
POLL_S = 1.0
"""Azure: "we recommend that you poll the service once per second"."""
ORPHANS_EVERY = 5


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class NodeAgent:
    """The decisions of one poll, against one node's cluster view."""

    cluster: Cluster
    node: str
    vm: str
    read_events: Callable[[], dict[str, Any]]
    clock: Callable[[], datetime] = _now
    evicted: set[str] = field(default_factory=set)
    """Events whose workers were evicted (this node's Preempts)."""
    reaped: set[str] = field(default_factory=set)
    """Events whose VM's leftover workers were force-deleted."""
    polls: int = 0

    def poll(self) -> None:
        """Read the document once and act on it."""
        _, events = parse(self.read_events())
        own = own_preempt(events, self.vm)
        if own is not None and own.event_id not in self.evicted:
            self._evict_own(own.event_id, own.not_before)
        for event in started_preempts(events, self.clock()):
            if event.event_id not in self.reaped:
                self._reap(event.event_id, set(event.resources))
        self.polls += 1
        if self.polls % ORPHANS_EVERY == 0:
            self._reap_orphans()

    def _evict_own(self, event_id: str, not_before: datetime | None) -> None:
        pods = self.cluster.workers(self.node)
        for pod in pods:
            self.cluster.evict(pod)
        # After the deletes: SIGTERM first, the scheduler's view second (no replacement can be
        # created before the old pod object is gone anyway: it has the same name).
        self.cluster.cordon(self.node)
        self.evicted.add(event_id)
        LOG.warning(
            "Preempt %s of this VM %s (not before %s): evicted %s, cordoned %s",
            event_id,
            self.vm,
            not_before,
            [p.metadata.name for p in pods] or "no worker",
            self.node,
        )

    def _reap(self, event_id: str, vms: set[str]) -> None:
        nodes = self.cluster.nodes_by_vm()
        for vm in vms:
            node = nodes.get(vm.lower())
            for pod in self.cluster.workers(node) if node else []:
                if self.cluster.force_delete(pod):
                    LOG.warning(
                        "VM %s preempted (%s): force-deleted %s", vm, event_id, pod.metadata.name
                    )
        self.reaped.add(event_id)

    def _reap_orphans(self) -> None:
        nodes = self.cluster.node_names()
        for pod in self.cluster.workers():
            node = pod.spec.node_name
            if node and node not in nodes and self.cluster.force_delete(pod):
                LOG.warning("node %s is gone: force-deleted %s", node, pod.metadata.name)


def run(agent: NodeAgent, stop: Callable[[], bool], sleep: Callable[[float], None]) -> None:
    """Poll once a second until ``stop()``; a failed poll is logged and the next one tries."""
    while not stop():
        started = time.monotonic()
        try:
            agent.poll()
        except Exception as exc:  # noqa: BLE001 one bad answer must not end the agent
            LOG.error("poll failed: %s: %s", type(exc).__name__, str(exc).splitlines()[:1])
        sleep(max(0.0, POLL_S - (time.monotonic() - started)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.node_agent", description=__doc__)
    parser.add_argument("--node", default=os.environ.get("NODE_NAME", ""))
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", ""))
    parser.add_argument("--worker-selector", required=True, help="label selector of the workers")
    parser.add_argument("--metadata-url", default=METADATA_URL)
    args = parser.parse_args(argv)
    if not args.node or not args.namespace:
        parser.error("--node and --namespace (or NODE_NAME and POD_NAMESPACE) are required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node-agent %(message)s")
    from kubernetes import client, config

    config.load_incluster_config()
    cluster = Cluster(client.CoreV1Api(), args.namespace, args.worker_selector)
    vm = cluster.vm_of(args.node)
    if vm is None:
        LOG.error("node %s has no Azure VM in its providerID: nothing to watch", args.node)
        return BAD_INPUT
    try:  # the first request enables Scheduled Events for this VM
        fetch(args.metadata_url, FIRST_CALL_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        LOG.error("Scheduled Events did not answer yet (%s); polling on", exc)
    LOG.info("watching Scheduled Events for %s (node %s)", vm, args.node)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stopping.append(signum))
    agent = NodeAgent(cluster, args.node, vm, lambda: fetch(args.metadata_url))
    run(agent, lambda: bool(stopping), time.sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
