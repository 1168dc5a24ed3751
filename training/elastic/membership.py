"""One node's membership in the run's etcd keys: the keys, their reads and transactions, this
node's lease and probe port, and the watch that keeps a view of the keys current.

Layout under ``/spot-lab/rendezvous/<run_id>/`` (etcd v3 API, docs/rendezvous.md):
- ``state``: JSON with the round, its members (null while the round is open), the previous
  round's members, the bootstrap address of the round's rank 0, and ``closed``. Written only by
  a transaction that compares its mod revision with the one the writer read (absent: created
  only if still absent).
- ``nodes/<id>``: one per live agent: its address, its probe port and ``left``. Attached to the
  node's lease, which the agent keeps alive while its own loop makes progress.
- ``join/<round>/<id>``: written once by each node that joins an open round, with the address
  and the port of the socket it holds for the workers' store, were it rank 0; on a lease of the
  join timeout; withdrawn when the node leaves. Not watched: only the node that may complete
  the round reads and follows them (training/elastic/key_copy.py, ``Joins``).
- ``unreachable/<reporter>/<target>``: a peer the reporter cannot reach
  (training/elastic/reachability.py); on the reporter's lease.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from training.elastic import etcd_v3
from training.elastic.etcd_v3 import Backoff, Etcd, EtcdError, WatchCompacted, prefix_end
from training.elastic.key_copy import KeyCopy
from training.elastic.liveness import ProbeServer, Progress
from training.elastic.rounds import Timing, View

logger = logging.getLogger(__name__)

ROOT = "/spot-lab"
CATCH_UP_S = 0.5
"""How long a node waits for its watch to deliver its own last write (or the write that beat
it) before it reads the keys itself: the watch is milliseconds behind unless etcd is away."""
EXPIRY_CHECK_S = 0.5
"""How often etcd's leader looks for expired leases (``server/lease/lessor.go``, ``runLoop``):
part of the fence's margin, with one keep-alive's timeout (``Membership.fence``)."""


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` as (host, port) (torchrun's
    ``--rdzv-endpoint``, the operator's PET_RDZV_ENDPOINT); ValueError naming the value."""
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else rest or None
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, None  # a name, an IPv4 address, or a bare IPv6 address
    if not host:
        raise ValueError(f"PET_RDZV_ENDPOINT {endpoint!r} names no host (host:port)")
    if port is None:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"PET_RDZV_ENDPOINT {endpoint!r} needs a port from 1 to 65535")
    return host, int(port)


class Membership:
    """This node's keys in one run, and the view of the others'."""

    def __init__(
        self,
        client: Etcd,
        watch_client: Etcd,
        run_id: str,
        node: str,
        addr: str,
        timing: Timing,
        progress: Progress,
        saw: Callable[[dict[str, dict[str, Any]]], None] = lambda nodes: None,
    ) -> None:
        self.client, self._watch_client = client, watch_client
        self._saw = saw
        """Told every registered node read, so that a key that expired is still probed where
        it was (training/elastic/liveness.py, ``Detector``)."""
        self.node, self.addr, self.timing, self.progress = node, addr, timing, progress
        self.root = f"{ROOT}/rendezvous/{run_id}"
        self.node_key = f"{self.root}/nodes/{node}"
        self.probe: ProbeServer | None = None
        self.stop = threading.Event()
        self._copy = KeyCopy(self.root)
        self._watched = (f"{self.root}/nodes/", prefix_end(f"{self.root}/"))
        """The keys the copy holds: ``nodes/``, ``state`` and ``unreachable/`` sort after
        ``join/``, so one range leaves the joins out."""
        self._changed = threading.Condition()
        self.changes = 0
        """How many changes the watches applied (``notify``)."""
        self._threads: list[threading.Thread] = []
        self._written_index = 0
        self.etcd_down_since: float | None = None
        self.joined_round = 0
        self.lease = 0
        """The lease this node's key lives on (0: none granted yet)."""
        self.granted_ttl_s = float(timing.ttl_s)
        """The TTL etcd granted the lease (it may grant more than asked, never less)."""
        self.renewed_at = float("-inf")
        """When the last keep-alive (or grant) that etcd answered was sent (monotonic): etcd
        renewed the lease after that moment, so the key lives at least a TTL past it."""
        self.port_held: socket.socket | None = None
        """The socket whose port this node's join key publishes: listening from the join on,
        so a peer's connection waits in its backlog, until rank 0's agent hands it to the
        workers' store (training/elastic/rendezvous.py) or another node became rank 0."""

    # -- reads ------------------------------------------------------------------------------
    def read_state(self) -> tuple[dict[str, Any] | None, int]:
        kv = self.client.get(f"{self.root}/state")
        return (None, 0) if kv is None else (json.loads(kv.value), kv.mod_revision)

    def in_round(self, round_: int) -> bool | None:
        """Whether etcd, read now (the watched copy may be as old as a pause), has this node
        in ``round_``; None when etcd does not answer."""
        try:
            state, _ = self.read_state()
        except EtcdError:
            return None
        members = (state or {}).get("members") or ()
        return state is not None and state.get("round") == round_ and self.node in members

    @property
    def view(self) -> View:
        """The run's keys as the watch keeps them (an empty View before the first read)."""
        return self._copy.view()

    def read_view(self) -> View:
        """Read the run's keys (one range read) into the watched copy, unless the copy is
        newer already."""
        kvs, revision = self.client.range(*self._watched)
        self._saw(self._copy.load(kvs, revision))
        return self._copy.view()

    def current_view(self) -> View:
        """The watched view once it holds this node's last write (or the write that beat it):
        waited for while the watch runs, read when it lags or runs no more."""
        target = self._written_index

        def caught_up() -> bool:
            return self._copy.revision >= max(target, 1)

        if not self._threads or self.stop.is_set():
            return self.read_view()
        if not caught_up():
            with self._changed:
                self._changed.wait_for(caught_up, CATCH_UP_S)
        return self._copy.view() if caught_up() else self.read_view()

    # -- transactions -------------------------------------------------------------------------
    def _txn(
        self, compare: list[dict], success: list[dict], keys: list[str], watched: bool = True
    ) -> bool:
        """A transaction on ``keys`` (the compared ones, under the run's root). Its revision,
        or the compared keys' own when the compare failed, is what the view must reach when
        the keys are ``watched``."""
        done, revision, current = self.client.txn_or_read(compare, success, keys)
        seen = revision if done else max((kv.mod_revision for kv in current), default=revision)
        if watched:
            self._written_index = max(self._written_index, seen)
        return done

    def write_state(self, state: dict[str, Any], index: int | None) -> bool:
        """Put the state if its mod revision is still ``index`` (None: if still absent)."""
        key = f"{self.root}/state"
        compare = etcd_v3.absent(key) if index is None else etcd_v3.mod_revision_is(key, index)
        return self._txn([compare], [etcd_v3.put(key, json.dumps(state))], [key])

    def update_state(self, change: Any, round_: int) -> None:
        while True:
            state, index = self.read_state()
            base = state or {"round": round_, "members": None, "previous": []}
            if self.write_state(change(base), None if state is None else index):
                return

    def join(self, round_: int) -> None:
        """Join ``round_``, publishing the port this node holds for the workers' store."""
        if self.port_held is None:
            self.port_held = socket.socket()
            self.port_held.bind(("", 0))
            self.port_held.listen(128)
        info = {"addr": self.addr, "port": self.port_held.getsockname()[1]}
        key = f"{self.root}/join/{round_}/{self.node}"
        lease = self.client.grant(self.timing.join_timeout_s)
        put = [etcd_v3.put(key, json.dumps(info), lease)]
        if not self._txn([etcd_v3.absent(key)], put, [key], watched=False):
            with contextlib.suppress(EtcdError):
                self.client.revoke(lease)  # joined already (a retry after a lost answer)
        self.joined_round = round_
        self.notify()  # a change no watch of this node sees: the loop looks again at once

    def take_port(self) -> socket.socket | None:
        """The held socket, now the caller's (rank 0's workers' store)."""
        held, self.port_held = self.port_held, None
        return held

    def release_port(self) -> None:
        """Another node is rank 0: the held port is not needed."""
        held = self.take_port()
        if held is not None:
            held.close()

    def forget_rounds_before(self, round_: int, view: View) -> None:
        """Old rounds' join keys: keep every agent's copy of the keys to one round."""
        for old in (r for r in view.joined if r < round_):
            with contextlib.suppress(EtcdError):
                self.client.delete(f"{self.root}/join/{old}/", prefix=True)

    # -- etcd away ---------------------------------------------------------------------------
    def note_down(self, exc: BaseException) -> float:
        """How long etcd has been unreachable, saying so once."""
        if self.etcd_down_since is None:
            self.etcd_down_since = time.monotonic()
            logger.warning(
                "etcd unreachable (%s); retrying, the group trains on for %.1f s more at most "
                "(the fence)",
                exc,
                max(0.0, self.fence() - self.etcd_down_since),
            )
        return time.monotonic() - self.etcd_down_since

    @property
    def margin_s(self) -> float:
        """What the fence keeps back from the TTL: one keep-alive's timeout and etcd's check
        for expired leases."""
        return self.client.keep_alive_timeout_s + EXPIRY_CHECK_S

    def fence(self) -> float:
        """Until when (monotonic) this node's key is sure to live: the TTL etcd granted past
        the last keep-alive it answered, less ``margin_s``. Past it, the others may have found
        the key gone and formed a round without this node: its workers must not step
        (training/elastic/permit.py, ``Keeper``)."""
        return self.renewed_at + self.granted_ttl_s - self.margin_s

    def renew_if_fenced(self) -> None:
        """Renew the lease now when the fence has passed (etcd was away): a round this node
        joins must start its workers on a lease etcd renewed, not wait for the heartbeat's
        next period, or the first poll of its monitor loop finds the old fence and re-forms
        the group again. Raises ``EtcdError`` while etcd is still away."""
        if time.monotonic() >= self.fence():
            self.beat()

    def note_up(self) -> None:
        if self.etcd_down_since is not None:
            logger.info(
                "etcd reachable again after %.1f s", time.monotonic() - self.etcd_down_since
            )
            self.etcd_down_since = None

    # -- this node's key, its lease, its probe port, and the watch -----------------------------
    def _node_info(self, left: bool = False) -> str:
        assert self.probe is not None
        return json.dumps({"addr": self.addr, "port": self.probe.port, "left": left})

    def start(self) -> None:
        """Listen for probes, register, start the lease's keep-alive and the watch (once)."""
        if self._threads:
            return
        if self.probe is None:
            self.probe = ProbeServer(self.node, self.progress)
        self.beat()  # may raise: the caller retries while etcd is away
        for target, name in ((self._heartbeats, "rdzv-heartbeat"), (self._watch, "rdzv-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def beat(self) -> None:
        """Keep this node's lease alive, while its agent's loop makes progress.

        A keep-alive renews the lease without writing the key (etcd's ``LeaseKeepAlive``), so
        heartbeats wake nobody's watch. A lease that expired (etcd was away longer than the
        TTL: the probe kept the node alive meanwhile) is replaced by a new one, and the key is
        written again only if absent: a node that left keeps its ``left`` key.
        """
        if self.progress.stalled():
            return  # a wedged agent: its lease expires, as a frozen node's does
        sent = time.monotonic()
        if self.lease and (ttl := self.client.keep_alive(self.lease)) > 0:
            self.renewed_at, self.granted_ttl_s = sent, float(ttl)  # the TTL it renewed to
            return
        lease, ttl = self.client.grant_ttl(self.timing.ttl_s)
        key = self.node_key
        if self._txn([etcd_v3.absent(key)], [etcd_v3.put(key, self._node_info(), lease)], [key]):
            self.lease, self.granted_ttl_s, self.renewed_at = lease, float(ttl), sent
        else:
            self.client.revoke(lease)

    @property
    def beat_every_s(self) -> float:
        """The keep-alive period: the configured interval, and never more than a third of the
        granted TTL (two keep-alives may fail before the key expires)."""
        return min(float(self.timing.keep_alive_interval_s), self.granted_ttl_s / 3)

    def _heartbeats(self) -> None:
        # After a failed keep-alive the next goes out sooner (backed off, never later than a
        # period): a leader's election takes about a second, and the fence does not wait.
        backoff, wait_s = Backoff(), self.beat_every_s
        while not self.stop.wait(wait_s):
            try:
                self.beat()
                self.note_up()
                backoff.reset()
                wait_s = self.beat_every_s
            except EtcdError as exc:
                self.note_down(exc)
                wait_s = min(backoff.next(), self.beat_every_s)

    def notify(self) -> None:
        """Wake whoever waits in ``wait_for_change``."""
        with self._changed:
            self.changes += 1
            self._changed.notify_all()

    def _watch(self) -> None:
        """Keep ``view`` current: read the keys once, then apply the watch's events from the
        read's revision on, one stream at a time (a quiet stream ends after five heartbeat
        intervals and the next starts where it ended). Read again only when the watch broke:
        etcd away, or its history compacted past the copy. A broken watch (an error line, etcd
        away) is opened again after a ``Backoff``, never at once."""
        fresh = True
        backoff = Backoff()
        while not self.stop.is_set():
            try:
                if fresh:
                    self.read_view()
                    fresh = False
                    self.notify()
                idle_s = self.timing.keep_alive_interval_s * 5
                start, end = self._watched
                for events in self._watch_client.watch(
                    start, self._copy.revision, idle_s, end, progress=self._copy.advance
                ):
                    backoff.reset()
                    self._saw(self._copy.apply(events))
                    self.notify()
                    if self.stop.is_set():
                        return
            except WatchCompacted:
                fresh = True  # fell behind etcd's history: the next read catches up
            except EtcdError as exc:
                fresh = True
                self.note_down(exc)
                self.stop.wait(backoff.next())
            except Exception as exc:  # noqa: BLE001 - a watch must never kill the agent
                fresh = True
                logger.warning("rendezvous watch: %s", exc)
                self.stop.wait(backoff.next())

    def wait_for_change(self, timeout_s: float, since: int | None = None) -> bool:
        """Until a change after ``changes`` was ``since`` (at once if one came meanwhile: a
        change while the caller acted must not wait out the timeout), or ``timeout_s``;
        whether one came."""
        with self._changed:
            return self._changed.wait_for(
                lambda: since is not None and self.changes != since, timeout_s
            )

    def leave(self) -> None:
        """Leave for good, at once: the port refuses, the key says so, the join is withdrawn."""
        if self.probe is None or self.stop.is_set():
            return
        self.stop.set()
        self.probe.close()
        self.release_port()
        try:
            # On a lease of its own: the key must outlive the node's lease, for every peer to
            # read ``left`` rather than an expired key it would probe.
            lease = self.client.grant(max(self.timing.join_timeout_s, 60))
            self.client.txn([], [etcd_v3.put(self.node_key, self._node_info(left=True), lease)])
            if self.lease:
                self.client.revoke(self.lease)
        except EtcdError as exc:  # the refused probe says it all the same
            logger.warning("could not mark node %s as left: %s", self.node, exc)
        self.withdraw()

    def withdraw(self) -> None:
        """Take back this node's join: an open round must not make a going node a member (the
        others would wait for it as their rank 0); a completed round ignores the key. The node
        stays registered until it leaves, and a round waits for a live node it expects."""
        if self.joined_round:
            with contextlib.suppress(EtcdError):
                self.client.delete(f"{self.root}/join/{self.joined_round}/{self.node}")
