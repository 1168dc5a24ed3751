"""Reports of peers a node cannot reach, in etcd: how a partition is told from a death.

A node cut off from its peers but not from etcd keeps its lease alive, so its key stays fresh
and nobody may take it for dead; yet a group with it fails in its first collective. So every
node reports, under ``unreachable/<reporter>/<target>``, each peer whose probe
(training/elastic/liveness.py) it could not get answered while the peer's key was fresh, and
withdraws the report once the probe answers again. The rounds (training/elastic/rounds.py,
``excluded``) leave out of the next round the node the reports cut off, and only then the side
that still reaches each other forms its group.

A report of a fresh-keyed peer is filed for a refused probe too (a REJECT rule in one
direction): a refusal that counted as death let the node that could not reach a peer complete
every round without it while the others saw it waiting, without end. A report is withdrawn
only once the peer answered for ``HEAL_S`` without a miss, doubled each time the same report
is filed again: a link that flaps settles on the nodes that reach each other.

A report lives on the reporter's own lease: it goes with the reporter, and the keys of a run
stay one report per broken link. A node re-asks, at every step of its rendezvous, each peer it
reported, so a node left out rejoins once the partition heals (its probes answered again, its
own reports withdrawn, the members' withdrawn when they reach it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from training.elastic import etcd_v3
from training.elastic.etcd_v3 import Etcd, EtcdError

logger = logging.getLogger(__name__)

HEAL_S = 5.0
"""How long a reported peer must answer, every probe, before the report is withdrawn."""
HEAL_CAP_S = 60.0
PREFIX = "unreachable"
REFUSED = "refused"
"""A report's value when the probe was refused (RST), not unanswered: one end rejects the
other, which breaks a tie in ``rounds.excluded`` against the refused node."""
"""The reports' folder under the run's root: ``unreachable/<reporter>/<target>``."""


def parse_report(rel: list[str]) -> tuple[str, str] | None:
    """(reporter, target) for a key's path below the run's root, if it is a report."""
    if len(rel) == 3 and rel[0] == PREFIX:
        return rel[1], rel[2]
    return None


class Reports:
    """This node's reports: filed and withdrawn only on a change, each one etcd request."""

    def __init__(
        self,
        client: Etcd,
        root: str,
        node: str,
        lease: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.node, self._lease, self._clock = client, node, lease, clock
        self.prefix = f"{root}/{PREFIX}/{node}"
        self._filed: dict[str, int] = {}
        """Each target reported, with the lease the report was put on."""
        self._times: dict[str, int] = {}
        """Per target, how many times it was reported: each doubles the time to heal."""
        self._answering: dict[str, float] = {}
        """Per reported target, since when every probe of it was answered."""

    def heal_s(self, target: str) -> float:
        """How long ``target`` must answer before its report is withdrawn."""
        return min(HEAL_CAP_S, HEAL_S * 2 ** max(0, self._times.get(target, 1) - 1))

    def answered(self, target: str) -> None:
        """``target``'s probe was answered: the report goes once it answered long enough."""
        if target not in self._filed:
            return
        since = self._answering.setdefault(target, self._clock())
        if self._clock() - since >= self.heal_s(target):
            self.withdraw(target)

    @property
    def targets(self) -> set[str]:
        """The peers this node reported and has not heard from since."""
        self._drop_expired()
        return set(self._filed)

    def file(self, target: str, refused: bool = False) -> None:
        """``target``'s probe went unanswered (or was ``refused``) while its key was fresh."""
        self._drop_expired()
        self._answering.pop(target, None)
        lease = self._lease()
        if target == self.node or target in self._filed or not lease:
            return
        try:
            value = REFUSED if refused else ""
            self.client.txn([], [etcd_v3.put(f"{self.prefix}/{target}", value, lease)])
        except EtcdError as exc:  # the next unanswered probe files it again
            logger.warning("could not report %s as unreachable: %s", target, exc)
            return
        self._filed[target] = lease
        self._times[target] = self._times.get(target, 0) + 1
        logger.warning(
            "node %s cannot reach %s (no answer to its probe): reported", self.node, target
        )

    def withdraw(self, target: str) -> None:
        """This node reaches ``target`` again (or it is gone): withdraw the report."""
        self._answering.pop(target, None)
        if self._filed.pop(target, None) is None:
            return
        with contextlib.suppress(EtcdError):  # a report left behind goes with the lease
            self.client.delete(f"{self.prefix}/{target}")
        logger.info("node %s reaches %s again: report withdrawn", self.node, target)

    def ask_again(
        self, nodes: dict[str, dict[str, Any]], reached: Callable[[str, dict[str, Any]], bool]
    ) -> None:
        """Probe every peer reported (its answers withdraw the report, by the probe's hook),
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
