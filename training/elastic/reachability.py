"""Reports of peers a node cannot reach, in etcd: how a partition is told from a death.

A node cut off from its peers but not from etcd keeps its lease alive, so its key stays fresh
and nobody may take it for dead; yet a group with it fails in its first collective. So every
node reports, under ``unreachable/<reporter>/<target>``, each peer whose probe
(training/elastic/liveness.py) it could not get answered while the peer's key was fresh, and
withdraws the report once the probe answers again. The rounds (training/elastic/rounds.py,
``excluded``) leave out of the next round the node the reports cut off, and only then the side
that still reaches each other forms its group.

A report lives on the reporter's own lease: it goes with the reporter, and the keys of a run
stay one report per broken link. A node re-asks, at every step of its rendezvous, each peer it
reported, so a node left out rejoins once the partition heals (its probes answered again, its
own reports withdrawn, the members' withdrawn when they reach it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from training.elastic import etcd_v3
from training.elastic.etcd_v3 import Etcd, EtcdError

logger = logging.getLogger(__name__)

PREFIX = "unreachable"
"""The reports' folder under the run's root: ``unreachable/<reporter>/<target>``."""


def parse_report(rel: list[str]) -> tuple[str, str] | None:
    """(reporter, target) for a key's path below the run's root, if it is a report."""
    if len(rel) == 3 and rel[0] == PREFIX:
        return rel[1], rel[2]
    return None


class Reports:
    """This node's reports: filed and withdrawn only on a change, each one etcd request."""

    def __init__(self, client: Etcd, root: str, node: str, lease: Callable[[], int]) -> None:
        self.client, self.node, self._lease = client, node, lease
        self.prefix = f"{root}/{PREFIX}/{node}"
        self._filed: dict[str, int] = {}
        """Each target reported, with the lease the report was put on."""

    @property
    def targets(self) -> set[str]:
        """The peers this node reported and has not heard from since."""
        self._drop_expired()
        return set(self._filed)

    def file(self, target: str) -> None:
        """``target``'s probe went unanswered while its key was fresh."""
        self._drop_expired()
        lease = self._lease()
        if target == self.node or target in self._filed or not lease:
            return
        try:
            self.client.txn([], [etcd_v3.put(f"{self.prefix}/{target}", "", lease)])
        except EtcdError as exc:  # the next unanswered probe files it again
            logger.warning("could not report %s as unreachable: %s", target, exc)
            return
        self._filed[target] = lease
        logger.warning(
            "node %s cannot reach %s (no answer to its probe): reported", self.node, target
        )

    def withdraw(self, target: str) -> None:
        """``target`` answered: this node reaches it again."""
        if self._filed.pop(target, None) is None:
            return
        with contextlib.suppress(EtcdError):  # a report left behind goes with the lease
            self.client.delete(f"{self.prefix}/{target}")
        logger.info("node %s reaches %s again: report withdrawn", self.node, target)

    def ask_again(
        self, nodes: dict[str, dict[str, Any]], reached: Callable[[str, dict[str, Any]], bool]
    ) -> None:
        """Probe every peer reported (its answer withdraws the report, by the probe's hook),
        so a node left out by a partition rejoins once it heals; a peer gone says nothing."""
        for target in self.targets:
            if target in nodes:
                reached(target, nodes[target])
            else:
                self.withdraw(target)

    def _drop_expired(self) -> None:
        """Reports on a lease that was replaced (it expired while etcd was away) are gone."""
        lease = self._lease()
        for target in [t for t, on in self._filed.items() if on != lease]:
            del self._filed[target]
