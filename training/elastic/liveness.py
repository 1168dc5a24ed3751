"""Is a node's agent alive? A probe that answers for the agent's progress, not for a thread.

Each agent listens on a TCP port of its own and answers every connection with its node id,
while the agent's own loop (the monitor loop, a round) makes progress. A peer's verdict then
comes from the kernel as much as from the agent:
- refused (RST): nothing listens there any more (a kill, a crash, an agent that left), or a
  firewall's REJECT refuses a live agent in one direction: **dead** once its key is gone;
  while the key is fresh, a report (training/elastic/reachability.py), which the rounds turn
  into one decision every node shares (``rounds.excluded``): a killed node, refused by every
  peer, is left out at once, and a one-way refusal cannot make two nodes disagree;
- an answer with the node's id: **alive**, however busy: a starved or slow agent answers
  within the scheduler's latency, not within a heartbeat period;
- no answer in time (a VM that vanished sends no RST; a frozen process accepts but never
  answers), or an agent whose loop is wedged (it answers ``<id> stalled``): **unknown**. The
  rendezvous takes that for dead only once the node's heartbeat key has expired as well, so a
  slow node needs both a missed TTL and a missed probe to be taken for dead. A wedged agent
  stops refreshing its key too (training/elastic/membership.py), so it is treated as a frozen node;
- no connection at all (no route, no SYN-ACK in time: a partition, a dropping NetworkPolicy, a
  VM gone) while the key may be fresh: **unreachable**, judged as unknown, and the one verdict
  the monitor loop's ring acts on (a frozen process still completes the handshake in its
  kernel, so it stays unknown and waits out its key, as before).

``Detector`` turns probes into verdicts for the rendezvous, holding answers so that a monitor
loop does not probe on every tick.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5
"""How long a probe waits for a connection and an answer. A live agent answers in
milliseconds, even with every core busy (measured: bench/rendezvous_scale.py, the starvation
test); the probe decides only for a node whose heartbeat already expired."""
STALLED = b"stalled"


class Verdict(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"
    UNREACHABLE = "unreachable"


SILENT = frozenset({Verdict.UNKNOWN, Verdict.UNREACHABLE})
"""No answer: dead only once the key expired too; with a fresh key, a report."""


class Progress:
    """The heartbeat of the agent's own loop: the rendezvous beats it on every step of a
    round and on every ``num_nodes_waiting`` of the monitor loop. A thread that merely lives
    (the probe server, the key's heartbeat) is no proof the agent will ever join a round."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._last = time.monotonic()
        self._held_until = 0.0

    def beat(self) -> None:
        self._last = time.monotonic()

    def hold(self, until: float) -> None:
        """Progress until ``until`` (monotonic) without beats: work of the agent's own that
        is bounded by then (a going node's saves, which the next round waits for)."""
        self._held_until = until

    def stalled(self) -> bool:
        now = time.monotonic()
        return now - self._last > self.stall_s and now > self._held_until


class ProbeServer:
    """Answers every connection with this node's id (or that it is stalled), from a thread."""

    def __init__(self, node_id: str, progress: Progress | None = None, host: str = "") -> None:
        self.node_id, self.progress = node_id, progress
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rdzv-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        alive = self.node_id.encode() + b"\n"
        stalled = self.node_id.encode() + b" " + STALLED + b"\n"
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            wedged = self.progress is not None and self.progress.stalled()
            with conn, contextlib.suppress(OSError):
                conn.sendall(stalled if wedged else alive)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """Stop answering: from now on a probe is refused, which peers read as 'left'."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def probe(addr: str, port: int, node_id: str, timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """The verdict on ``node_id`` listening at ``addr:port``."""
    try:
        conn = socket.create_connection((addr, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return Verdict.DEAD
    except OSError as exc:  # no route, or no SYN-ACK in time: the network, not the process
        logger.debug("probe of %s at %s:%d: %s", node_id, addr, port, exc)
        return Verdict.UNREACHABLE
    answer = b""
    with conn:
        try:
            conn.settimeout(timeout_s)
            while not answer.endswith(b"\n"):
                chunk = conn.recv(256)
                if not chunk:
                    break
                answer += chunk
        except OSError:  # connected, no answer in time: a frozen process
            return Verdict.UNKNOWN
    if not answer:  # accepted and closed without a word: the listener is going away
        return Verdict.DEAD
    said = answer.strip().decode(errors="replace")
    if said == node_id:
        return Verdict.ALIVE
    if said == f"{node_id} {STALLED.decode()}":
        return Verdict.UNKNOWN  # its loop is wedged: as good as frozen
    return Verdict.DEAD  # another process on a reused address and port is not this node


class Detector:
    """Verdicts on peers from their keys and their probes, each answer held for a while.

    A node is dead when it marked itself ``left``, or when its key has expired and its probe
    is refused or goes unanswered. An 'alive' answer and a refusal are each held
    for a heartbeat period, so a monitor loop does not probe on every tick; no answer is asked
    again at the next look. A refusal is no verdict for good: a REJECT rule or a route flap
    refuses a live agent once, and a node that answers again is alive again (the round waits
    for it, and completes with it).
    """

    def __init__(
        self,
        probe_timeout_s: float,
        hold_alive_s: float,
        retry_s: float,
        on_probe: Callable[[str, Verdict, bool], None] | None = None,
        prober: Callable[[str, int, str, float], Verdict] | None = None,
    ) -> None:
        self._prober = prober
        """How a peer is asked (None: ``probe``; a test breaks one link with its own)."""
        self.probe_timeout_s, self.hold_alive_s, self.retry_s = (
            probe_timeout_s,
            hold_alive_s,
            retry_s,
        )
        self.on_probe = on_probe
        """Told every probe's verdict, and whether the node's key was fresh: an unanswered
        probe of a node with a fresh key is a report (training/elastic/reachability.py)."""
        self._verdicts: dict[str, tuple[float, Verdict]] = {}
        self._misses: dict[str, int] = {}
        """Per node, its probes in a row that went unanswered or were refused."""
        self._last_seen: dict[str, dict[str, Any]] = {}
        """Every node's address and probe port as last seen: a key that expired is still
        probed where it was."""

    def saw(self, nodes: dict[str, dict[str, Any]]) -> None:
        self._last_seen.update(nodes)

    def saw_published(self, probes: dict[str, dict[str, Any]]) -> None:
        """The probe addresses a completed round published for its members: where a member
        whose key this node never saw (it expired first) is asked before it counts as gone."""
        for node, where in probes.items():
            self._last_seen.setdefault(node, {**where, "left": False})

    def dead(self, node: str, info: dict[str, Any] | None, probe_live: bool) -> bool:
        """Left, or its key gone and its probe unanswered or refused.

        ``info`` is the node's key as read (None once expired). A node with a fresh key is
        never dead by its probe: a refusal (a REJECT rule in one direction refuses a live
        agent) or silence is a report (``on_probe``), which takes it out of a round only as
        ``rounds.excluded`` says, the same for every node. ``probe_live`` probes a node whose
        key is there, for that report: done only for the few nodes a new round waits for,
        never per member in the monitor loop. A node whose key this node never saw is probed
        where the round published it (``saw_published``); dead unprobed only when no address
        of it is known at all.
        """
        if info is not None:
            if not info["left"] and probe_live:
                self._probe_cached(node, info, True)
            return bool(info["left"])
        seen = self._last_seen.get(node)
        if seen is None:
            return True  # no key, no address: nothing to ask
        return self._probe_cached(node, seen, False) is not Verdict.ALIVE

    def reached(self, node: str, info: dict[str, Any] | None) -> bool:
        """This node's own probe of ``node`` was answered (now, or within the answer's hold).

        A fresh key is no proof: a node cut off from its peers but not from etcd keeps it
        fresh. A round completes only with joiners this says so of (training/elastic/rounds.py).
        """
        seen = info or self._last_seen.get(node)
        if seen is None or (info is not None and info["left"]):
            return False
        return self._probe_cached(node, seen, info is not None) is Verdict.ALIVE

    def unanswered(self, node: str, info: dict[str, Any] | None, misses: int = 2) -> bool:
        """``node``'s last ``misses`` probes in a row found no way to it (unreachable, or
        refused) while its key is fresh: a member its peers cannot reach, though etcd can (a
        partition). A frozen process (connected, silent) resets the count: its key decides.
        The monitor loop asks this of one member only, the next in the round's order."""
        if info is None or info["left"]:
            return False  # the key's own rules judge it
        self._probe_cached(node, info, True)
        return self._misses.get(node, 0) >= misses

    def forget(self, nodes: set[str] | None = None) -> None:
        """Drop the held answers (of ``nodes``, or all): the next look asks again."""
        for node in list(self._verdicts if nodes is None else nodes & self._verdicts.keys()):
            del self._verdicts[node]
            self._misses.pop(node, None)

    def prefetch(self, nodes: dict[str, dict[str, Any] | None], side_by_side: int = 32) -> None:
        """Probe every node of ``nodes`` (its key, or None once expired) that has no held
        answer, side by side. The completer of a round asks about every joiner: one probe
        after another would cost a round of N joiners N round trips."""
        todo: dict[str, tuple[dict[str, Any], bool]] = {}
        for node, info in nodes.items():
            seen = info or self._last_seen.get(node)
            if seen is None or (info is not None and info["left"]):
                continue
            if self._held(node) is None:
                todo[node] = (seen, info is not None)
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(min(side_by_side, len(todo)), "rdzv-probes") as pool:
            verdicts = pool.map(
                lambda n: self._probe(todo[n][0], n),
                list(todo),
            )
            for node, verdict in zip(list(todo), verdicts, strict=True):
                self._record(node, verdict, todo[node][1])

    def _probe(self, seen: dict[str, Any], node: str) -> Verdict:
        ask = self._prober or probe  # looked up now: a test may replace ``probe``
        return ask(seen["addr"], seen["port"], node, self.probe_timeout_s)

    def _held(self, node: str) -> Verdict | None:
        """The answer held for ``node``, while it holds (``_record``)."""
        cached = self._verdicts.get(node)
        return cached[1] if cached is not None and time.monotonic() < cached[0] else None

    def _probe_cached(self, node: str, seen: dict[str, Any], keyed: bool) -> Verdict:
        if (held := self._held(node)) is not None:
            return held
        verdict = self._probe(seen, node)
        return self._record(node, verdict, keyed)

    def _record(self, node: str, verdict: Verdict, keyed: bool) -> Verdict:
        """Hold a probe's answer, count its misses and tell ``on_probe``."""
        hold = self.retry_s if verdict in SILENT else self.hold_alive_s
        before = self._verdicts.get(node, (0.0, Verdict.ALIVE))[1]
        self._verdicts[node] = (time.monotonic() + hold, verdict)
        no_way = verdict in (Verdict.UNREACHABLE, Verdict.DEAD)
        self._misses[node] = self._misses.get(node, 0) + 1 if no_way else 0
        if verdict is not Verdict.ALIVE and verdict is not before:  # once, not every retry
            logger.info("node %s is %s (its probe)", node, verdict.value)
        if self.on_probe is not None:
            self.on_probe(node, verdict, keyed)
        return verdict
