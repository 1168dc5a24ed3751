"""The rendezvous: membership in etcd, with a failure detector that does not wait it out.

torch's dynamic rendezvous (etcd-v2) forms the next round only once a lost node's heartbeat
has expired, then waits a last call, polling once a second; a node evicted with notice is
waited out like a dead one; every heartbeat rewrites one shared key; and an etcd outage makes
every agent exit. This handler implements torch's public ``RendezvousHandler`` interface on the
same etcd v2 API and the same workers' store (``EtcdStore``), registered under a backend name
of ours, and differs where the time went:

- **A node that leaves says so.** An evicted agent marks its key ``left`` and closes its probe
  port before it exits (``leave``); nobody waits for its heartbeat.
- **A dead process is seen at once.** Every agent answers a TCP probe (training/liveness.py):
  a refused probe is a dead agent. A node whose heartbeat expired *and* whose probe goes
  unanswered is dead too (a frozen or vanished VM); a slow node answers its probe.
- **No last call after the first round.** A new round waits for exactly the nodes it expects
  (the last round's members and the live waiting nodes) until each has joined or is dead.
- **Heartbeats are keys of their own** (``nodes/<id>``, a TTL refreshed without waking
  watchers), so no two agents write the same key between rounds; each agent watches the
  run's directory instead of polling it.
- **etcd is not needed between rounds.** A failed heartbeat or watch is retried; the group
  trains on. A heartbeat that expired while etcd was away is answered by the probe.

Layout under ``/spot-lab/rendezvous/<run_id>/``: ``state`` (JSON: round, members or null
while the round is open, the previous round's members, closed), written only by
compare-and-swap; ``nodes/<id>`` (the node's address and probe port); ``join/<round>/<id>``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import etcd
from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from training.exit_codes import VERDICT_ENV
from training.launch import ROUND_FILE_ENV, RendezvousSettings
from training.liveness import PROBE_TIMEOUT_S, ProbeServer, Verdict, probe

logger = logging.getLogger(__name__)

BACKEND = "spot-etcd"
ROOT = "/spot-lab"
POLL_S = 0.05
"""How often a node in an open round looks again when no watch event woke it."""
ETCD_TIMEOUT_S = 2.0
"""One etcd request; an unreachable etcd must not hold a heartbeat or the monitor loop."""


class BadInputAfterJoin(RuntimeError):
    """A worker of this node found input no restart fixes; its log says which."""


_DEFAULTS = RendezvousSettings()


@dataclass(frozen=True)
class Timing:
    """The rendezvous' clocks: torchrun's ``--rdzv-conf`` keys, each the name without ``_s``
    (``RendezvousSettings`` in training/launch.py writes them and gives the defaults)."""

    keep_alive_interval_s: int = _DEFAULTS.keep_alive_interval_s
    keep_alive_max_attempt: int = _DEFAULTS.keep_alive_max_attempt
    last_call_timeout_s: int = _DEFAULTS.last_call_timeout_s
    join_timeout_s: int = _DEFAULTS.join_timeout_s
    probe_timeout_s: float = PROBE_TIMEOUT_S
    outage_timeout_s: int = 60
    """A round that cannot reach etcd for this long gives up (RendezvousConnectionError: the
    agent exits 138 and the operator makes a new pod). Between rounds an outage costs
    nothing."""

    @property
    def ttl_s(self) -> int:
        """A node's key lives this long past its last heartbeat."""
        return self.keep_alive_interval_s * self.keep_alive_max_attempt

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> Timing:
        """The conf's values where given, the defaults elsewhere; ValueError for a bad one."""
        given: dict[str, Any] = {}
        for f in fields(cls):
            raw = params.get(f.name.removesuffix("_s"))
            if raw is not None:
                given[f.name] = type(getattr(cls, f.name))(raw)
        return cls(**given)


@dataclass
class View:
    """What one read of the run's directory showed."""

    state: dict[str, Any] | None = None
    state_index: int = 0
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    joined: dict[int, list[str]] = field(default_factory=dict)
    """Per round, the nodes that joined it, in the order they did."""
    etcd_index: int = 0
    read_at: float = 0.0


def parse_view(result: etcd.EtcdResult, root: str) -> View:
    """The run directory's keys (one recursive GET) as a View."""
    view = View(etcd_index=int(result.etcd_index or 0), read_at=time.monotonic())
    joins: list[tuple[int, int, str]] = []
    for leaf in result.leaves:
        rel = leaf.key[len(root) :].strip("/").split("/")
        if rel == ["state"] and leaf.value:
            view.state, view.state_index = json.loads(leaf.value), leaf.modifiedIndex
        elif len(rel) == 2 and rel[0] == "nodes" and leaf.value:
            view.nodes[rel[1]] = json.loads(leaf.value)
        elif len(rel) == 3 and rel[0] == "join":
            joins.append((int(rel[1]), leaf.createdIndex, rel[2]))
    for round_, _, node in sorted(joins):
        view.joined.setdefault(round_, []).append(node)
    return view


def new_node_id() -> str:
    """Unique per agent process: a restarted pod is a new node."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class SpotRendezvousHandler(RendezvousHandler):
    """One agent's membership in the run's rendezvous."""

    def __init__(
        self,
        client: etcd.Client,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        timing: Timing,
        local_addr: str | None = None,
        verdict: Path | None = None,
        round_file: Path | None = None,
        watch_client: etcd.Client | None = None,
        store_client: etcd.Client | None = None,
    ) -> None:
        self.client, self.run_id, self.timing = client, run_id, timing
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.addr = local_addr or socket.getfqdn()
        self.node = new_node_id()
        self.verdict, self.round_file = verdict, round_file
        self.root = f"{ROOT}/rendezvous/{run_id}"
        self._store_dir = f"{ROOT}/store/{run_id}"
        self._store = EtcdStore(store_client or client, self._store_dir)
        self.round = 0
        """The round this node last joined (0: none yet)."""
        self._known_index = 0
        self._probe: ProbeServer | None = None
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._view = View()
        self._watch_client = watch_client or client
        self._threads: list[threading.Thread] = []
        self._verdicts: dict[str, tuple[float, Verdict]] = {}
        self.closed_by_us = False
        self._etcd_down_since: float | None = None
        self._last_seen: dict[str, dict[str, Any]] = {}
        """Every node's address and probe port as last seen: a key that expired is still
        probed where it was."""
        self._written_index = 0
        self._joined_round = 0

    # -- the interface ---------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        state = self._read_state()[0]
        return bool(state and state.get("closed"))

    def set_closed(self) -> None:
        self._update_state(lambda s: {**s, "closed": True})

    def shutdown(self) -> bool:
        """Called by torch's launcher whatever the outcome: nothing here, the agent settles it
        (``settle``), since torch's launcher would close the id on every ending but a signal."""
        return True

    def settle(self, close: bool) -> None:
        """Close the rendezvous for good (the run is over), or leave it open for a new pod."""
        if close and not self.closed_by_us:
            try:
                self.set_closed()
                self.closed_by_us = True
                logger.info("rendezvous %s closed: the run is over", self.run_id)
            except etcd.EtcdException as exc:
                logger.error("could not close rendezvous %s: %s", self.run_id, exc)
        elif not close:
            logger.info("rendezvous %s left open for a new pod to join", self.run_id)
        self.leave()

    def num_nodes_waiting(self) -> int:
        """>0 when the running group must re-form: a new round opened, a node waits to join,
        or a member is gone. From the watched view, with no etcd request: an etcd outage
        changes nothing here, and the group trains on."""
        view = self._view
        state = view.state
        if state is None or view.state_index < self._known_index or not self.round:
            return 0
        if state.get("round", 0) != self.round or state.get("members") is None:
            return 1  # a new round opened: this node must join it
        members = state["members"]
        if len(members) < self.max_nodes:
            # A killed node's key outlives it by up to a TTL: only a live node is waiting.
            waiting = [
                n for n in view.nodes if n not in members and not self._is_dead(n, view, True)
            ]
            if waiting:
                logger.info("%s waiting to join: re-forming the group", ", ".join(waiting))
                return len(waiting)
        gone = [m for m in members if m != self.node and self._is_dead(m, view)]
        if gone:
            logger.warning("round %d lost %s: re-forming the group", self.round, ", ".join(gone))
        return len(gone)

    def next_rendezvous(self) -> RendezvousInfo:
        if self.verdict is not None and self.verdict.exists():
            raise BadInputAfterJoin(
                f"a worker stopped on input no restart fixes: {self.verdict.read_text().strip()}"
            )
        deadline = time.monotonic() + self.timing.join_timeout_s
        opened = 0.0
        # A new round follows a fault: an answer from before it would make this round wait
        # for a node killed since, until the answer ran out.
        self._forget_answers()
        while True:
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"fewer than {self.min_nodes} nodes joined rendezvous {self.run_id} within "
                    f"{self.timing.join_timeout_s} s"
                )
            try:
                self._start()
                done = self._step(self._current_view(), opened)
            except etcd.EtcdException as exc:
                self._note_etcd_down(exc)
                down = time.monotonic() - (self._etcd_down_since or time.monotonic())
                if down > self.timing.outage_timeout_s:
                    raise RendezvousConnectionError(
                        f"etcd unreachable for {down:.0f} s during a rendezvous: {exc}"
                    ) from exc
                self._wait_for_change(self.timing.keep_alive_interval_s / 2)
                continue
            self._note_etcd_up()
            if isinstance(done, RendezvousInfo):
                return done
            opened = done
            self._wait_for_change(POLL_S)

    # -- one step of joining ------------------------------------------------------------------
    def _step(self, view: View, opened: float) -> RendezvousInfo | float:
        """Act on the view once: the RendezvousInfo when joined, else when the round opened."""
        state, index = view.state, view.state_index
        if state is None:
            self._write_state({"round": self.round + 1, "members": None, "previous": []}, None)
            return opened
        if state.get("closed"):
            raise RendezvousClosedError(f"rendezvous {self.run_id} is closed")
        round_, members = int(state["round"]), state.get("members")
        if members is not None:
            if self.node in members and round_ > self.round:
                return self._joined(state, index)
            if self.node in members or self._all_dead(members, view):
                # This node left round_ (its workers stopped), or every member is gone: round_
                # is over for everyone, the next one opens.
                nxt = {"round": max(round_, self.round) + 1, "members": None, "previous": members}
                self._write_state(nxt, index)
            return opened  # else: wait as a new node; the members see it and re-form
        if self._joined_round != round_:
            self._join(round_)
            return opened  # look again once the join shows
        joined = view.joined.get(round_, [])
        previous = state.get("previous") or []
        opened = opened or time.monotonic()
        if self._may_complete(joined, previous, view, opened):
            order = [n for n in previous if n in joined] + [n for n in joined if n not in previous]
            done = {"round": round_, "members": order[: self.max_nodes], "previous": previous}
            if self._write_state(done, index):
                self._forget_rounds_before(round_, view)
        return opened

    def _forget_rounds_before(self, round_: int, view: View) -> None:
        """Old rounds' join keys: every watch re-reads the directory, keep it to one round."""
        for old in (r for r in view.joined if r < round_):
            with contextlib.suppress(etcd.EtcdException):
                self.client.delete(f"{self.root}/join/{old}", recursive=True, dir=True)

    def _may_complete(
        self, joined: list[str], previous: list[str], view: View, opened: float
    ) -> bool:
        if len(joined) < self.min_nodes:
            return False
        if len(joined) >= self.max_nodes:
            return True
        expected = set(previous) | {n for n, info in view.nodes.items() if not info["left"]}
        pending = [n for n in expected if n not in joined and not self._is_dead(n, view, True)]
        if pending:
            return False
        # A group that starts afresh (the first round, or none of the last round's members
        # survived) waits a last call for nodes that have not even registered yet.
        afresh = not any(n in joined for n in previous)
        return not afresh or time.monotonic() - opened >= self.timing.last_call_timeout_s

    def _joined(self, state: dict[str, Any], index: int) -> RendezvousInfo:
        round_, members = int(state["round"]), state["members"]
        self.round, self._known_index = round_, index
        rank, world = members.index(self.node), len(members)
        # Whoever completed this round found every left-out node of the last one dead. An
        # answer this node cached before then would count a just-killed node as waiting and
        # re-form the new group at once: ask again.
        self._forget_answers(set(state.get("previous") or []) - set(members))
        store = PrefixStore(f"torch.rendezvous.{self.run_id}.{round_}", self._store)
        if self.round_file is not None:
            self.round_file.write_text(json.dumps({"round": round_, "members": world}))
        logger.info(
            "node %s joined round %d of rendezvous %s as rank %d of %d",
            self.node,
            round_,
            self.run_id,
            rank,
            world,
        )
        info = RendezvousStoreInfo.build(rank, store, local_addr=self.addr)
        return RendezvousInfo(store, rank, world, info)

    # -- liveness -----------------------------------------------------------------------------
    def _is_dead(self, node: str, view: View, probe_live: bool = False) -> bool:
        """Left, or its process gone: a refused probe, or an expired key and no answer.

        ``probe_live`` probes a node whose key is still there too, for a refused probe (a
        killed agent): done only for the few nodes a new round waits for, never per member
        in the monitor loop.
        """
        info = view.nodes.get(node)
        if info is not None and (info["left"] or not probe_live):
            return bool(info["left"])
        seen = info or self._last_seen.get(node)
        if seen is None:
            return True  # expired before this node ever saw it
        verdict = self._probe_cached(node, seen)
        return verdict is Verdict.DEAD or (verdict is Verdict.UNKNOWN and info is None)

    def _all_dead(self, members: list[str], view: View) -> bool:
        return bool(members) and all(self._is_dead(m, view, True) for m in members)

    def _forget_answers(self, nodes: set[str] | None = None) -> None:
        """Drop cached 'alive' and 'unknown' answers (of ``nodes``, or all); death is final."""
        for node in list(self._verdicts if nodes is None else nodes & self._verdicts.keys()):
            if self._verdicts[node][1] is not Verdict.DEAD:
                del self._verdicts[node]

    def _probe_cached(self, node: str, seen: dict[str, Any]) -> Verdict:
        now = time.monotonic()
        cached = self._verdicts.get(node)
        if cached is not None and now < cached[0]:
            return cached[1]
        verdict = probe(seen["addr"], seen["port"], node, self.timing.probe_timeout_s)
        # An answer holds for a heartbeat period; death is final; no answer is asked again.
        hold = {Verdict.ALIVE: self.timing.keep_alive_interval_s, Verdict.DEAD: 1e9}
        self._verdicts[node] = (time.monotonic() + hold.get(verdict, POLL_S), verdict)
        if verdict is not Verdict.ALIVE:
            logger.info("node %s is %s (its probe)", node, verdict.value)
        return verdict

    # -- etcd ---------------------------------------------------------------------------------
    def _read_state(self) -> tuple[dict[str, Any] | None, int]:
        try:
            result = self.client.read(f"{self.root}/state")
        except etcd.EtcdKeyNotFound:
            return None, 0
        return json.loads(result.value), result.modifiedIndex

    def _read_view(self) -> View:
        try:
            result = self.client.read(self.root, recursive=True)
        except etcd.EtcdKeyNotFound:
            return View(read_at=time.monotonic())
        view = parse_view(result, self.root)
        for node, info in view.nodes.items():
            self._last_seen[node] = info
        return view

    def _current_view(self) -> View:
        """The watched view, or a fresh read when it may predate this node's last write."""
        view = self._view
        if view.etcd_index < self._written_index or not view.read_at:
            view = self._read_view()
            if view.etcd_index >= self._view.etcd_index:
                self._view = view
        return view

    def _write(self, key: str, value: str | None, **kwargs: Any) -> etcd.EtcdResult:
        result = self.client.write(key, value, **kwargs)
        self._written_index = max(self._written_index, int(result.modifiedIndex or 0))
        return result

    def _write_state(self, state: dict[str, Any], index: int | None) -> bool:
        """Compare-and-swap against ``index`` (None: create only if absent)."""
        cond: dict[str, Any] = {"prevExist": False} if index is None else {"prevIndex": index}
        try:
            self._write(f"{self.root}/state", json.dumps(state), **cond)
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound, etcd.EtcdAlreadyExist):
            self._written_index = self._view.etcd_index + 1  # read again before acting
            return False
        return True

    def _update_state(self, change: Any) -> None:
        while True:
            state, index = self._read_state()
            base = state or {"round": self.round, "members": None, "previous": []}
            if self._write_state(change(base), None if state is None else index):
                return

    def _join(self, round_: int) -> None:
        key = f"{self.root}/join/{round_}/{self.node}"
        with contextlib.suppress(etcd.EtcdAlreadyExist):
            self._write(key, "1", prevExist=False, ttl=self.timing.join_timeout_s)
        self._joined_round = round_

    def _note_etcd_down(self, exc: BaseException) -> None:
        if self._etcd_down_since is None:
            self._etcd_down_since = time.monotonic()
            logger.warning("etcd unreachable (%s); retrying, the group trains on", exc)

    def _note_etcd_up(self) -> None:
        if self._etcd_down_since is not None:
            logger.info(
                "etcd reachable again after %.1f s", time.monotonic() - self._etcd_down_since
            )
            self._etcd_down_since = None

    # -- this node's key, its probe port, and the watch -------------------------------------
    def _node_info(self, left: bool = False) -> str:
        assert self._probe is not None
        return json.dumps({"addr": self.addr, "port": self._probe.port, "left": left})

    def _start(self) -> None:
        """Listen for probes, register, start the heartbeat and the watch (once)."""
        if self._threads:
            return
        if self._probe is None:
            self._probe = ProbeServer(self.node)
        # torch's EtcdStore.get watches from index 0 when the store's directory is missing:
        # a rank that reads between rank 0's two writes would wait out the store's timeout.
        with contextlib.suppress(etcd.EtcdAlreadyExist, etcd.EtcdNotFile):
            self.client.write(self._store_dir, None, dir=True, prevExist=False)
        self._beat()  # may raise: the caller retries while etcd is away
        for target, name in ((self._heartbeats, "rdzv-heartbeat"), (self._watch, "rdzv-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _beat(self) -> None:
        # etcd v2 API, "Refreshing key TTL": refresh=true renews the TTL without notifying
        # watchers (python-etcd's Client.refresh), so heartbeats wake nobody's watch.
        key = f"{self.root}/nodes/{self.node}"
        try:
            self.client.refresh(key, ttl=self.timing.ttl_s)
        except etcd.EtcdKeyNotFound:
            # First beat, or the key expired while etcd was away: the probe kept us alive.
            self._write(key, self._node_info(), ttl=self.timing.ttl_s)

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.timing.keep_alive_interval_s):
            try:
                self._beat()
                self._note_etcd_up()
            except etcd.EtcdException as exc:
                self._note_etcd_down(exc)

    def _watch(self) -> None:
        """Keep ``_view`` current: read the directory, then wait for its next change."""
        while not self._stop.is_set():
            try:
                view = self._read_view()
                if view.etcd_index >= self._view.etcd_index:
                    self._view = view
                with self._changed:
                    self._changed.notify_all()
                self._watch_client.read(
                    self.root,
                    wait=True,
                    recursive=True,
                    waitIndex=view.etcd_index + 1,
                    timeout=self.timing.keep_alive_interval_s * 5,
                )
            except etcd.EtcdWatchTimedOut:
                continue
            except etcd.EtcdEventIndexCleared:
                continue  # fell behind etcd's event history: the next read catches up
            except etcd.EtcdException as exc:
                self._note_etcd_down(exc)
                self._stop.wait(self.timing.keep_alive_interval_s / 2)
            except Exception as exc:  # noqa: BLE001 - a watch must never kill the agent
                logger.warning("rendezvous watch: %s", exc)
                self._stop.wait(self.timing.keep_alive_interval_s / 2)

    def _wait_for_change(self, timeout_s: float) -> None:
        with self._changed:
            self._changed.wait(timeout_s)

    def leave(self) -> None:
        """Leave for good, at once: the key says so and the probe port refuses."""
        if self._probe is None or self._stop.is_set():
            return
        self._stop.set()
        self._probe.close()
        try:
            self.client.write(
                f"{self.root}/nodes/{self.node}",
                self._node_info(left=True),
                ttl=max(self.timing.join_timeout_s, 60),
            )
        except etcd.EtcdException as exc:  # the refused probe says it all the same
            logger.warning("could not mark node %s as left: %s", self.node, exc)


def _client(params: RendezvousParameters, read_timeout_s: float = ETCD_TIMEOUT_S) -> etcd.Client:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=2379)
    protocol = str(params.get("protocol", "http")).strip().lower()
    return etcd.Client(host, port, protocol=protocol, read_timeout=read_timeout_s)


_created: list[SpotRendezvousHandler] = []


def create_handler(params: RendezvousParameters) -> SpotRendezvousHandler:
    """The handler for torchrun's parameters (the PET_* env the operator sets)."""
    # python-etcd logs every failed request; an outage is said once, here.
    logging.getLogger("etcd.client").setLevel(logging.CRITICAL)
    verdict = os.environ.get(VERDICT_ENV)
    round_file = os.environ.get(ROUND_FILE_ENV)
    handler = SpotRendezvousHandler(
        _client(params),
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        Timing.from_params(params),
        local_addr=params.local_addr,
        verdict=Path(verdict) if verdict else None,
        round_file=Path(round_file) if round_file else None,
        watch_client=_client(params),
        # The workers' store waits for its keys with watches of its own; torch's default.
        store_client=_client(params, read_timeout_s=60),
    )
    _created.append(handler)
    return handler


def register() -> str:
    """Register this backend (idempotent); the name to launch with."""
    rendezvous_handler_registry.register(BACKEND, create_handler)
    return BACKEND


def created() -> list[SpotRendezvousHandler]:
    """The handlers this process's agent made (one per launch)."""
    return list(_created)
