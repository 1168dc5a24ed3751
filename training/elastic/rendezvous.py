"""The rendezvous: membership in etcd, with a failure detector that does not wait it out.

torch's dynamic rendezvous forms the next round only once a lost node's heartbeat has
expired, then waits a last call, polling once a second; a node evicted with notice is waited
out like a dead one; every heartbeat rewrites one shared key; an etcd outage makes every agent
exit; and its etcd backends speak etcd's v2 API, which etcd 3.6 removed. This handler
implements torch's public ``RendezvousHandler`` interface on etcd's v3 API (leases,
transactions, watches: docs/rendezvous.md), registered under a backend name of ours, and
differs where the time went:

- **A node that leaves says so.** An evicted agent withdraws its join of an open round, makes
  its node's save durable (the next round waits for that), then marks its key ``left`` and
  closes its probe port; nobody waits for it longer.
- **A dead or wedged agent is seen.** Every agent answers a TCP probe (training/elastic/liveness.py)
  while its own loop makes progress: a refused probe is a dead agent; a node whose heartbeat
  expired *and* whose probe goes unanswered (a frozen or vanished VM, a wedged agent) is dead
  too; a slow node answers its probe.
- **No last call after the first round.** A new round waits for exactly the nodes it expects
  (the last round's members and the live waiting nodes) until each has joined or is dead, and
  completes only with joiners that are still alive (training/elastic/rounds.py).
- **Nothing waits on a member once its round completed.** The round's state carries rank 0's
  bootstrap address, so no member waits in the store for a rank 0 that died meanwhile
  (torch's ``RendezvousStoreInfo.build`` would wait 300 s, then raise ``LookupError``).
- **The workers' store is a TCPStore in rank 0's agent**, as torch's c10d handler shares its
  own (``use_agent_store``), new for every round, served on the very socket whose port the
  round published: the port is never free for another process to take. The agents' own store
  (torch's exit barrier) is on etcd, so no agent waits on a frozen rank 0.
- **Heartbeats are leases**, kept alive without waking watchers; each agent watches the run's
  keys from the revision it read instead of polling them (training/elastic/membership.py).
- **etcd is not needed between rounds.** A failed heartbeat or watch is retried; the group
  trains on. A heartbeat that expired while etcd was away is answered by the probe.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

from training.elastic import closing, rounds
from training.elastic.agent_store import AgentStore
from training.elastic.etcd_v3 import Etcd, EtcdError, Members, Tls
from training.elastic.exit_codes import VERDICT_ENV
from training.elastic.key_copy import Joins
from training.elastic.launch import ETCD_MEMBERS, MEMBERS_SEPARATOR, ROUND_FILE_ENV
from training.elastic.liveness import Detector, Progress, Verdict
from training.elastic.membership import ROOT, Membership, parse_endpoint
from training.elastic.permit import Keeper, Permit
from training.elastic.reachability import Reports
from training.elastic.round_store import RoundStore
from training.elastic.rounds import Me, Quorum, Timing, View

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND",
    "BadInputAfterJoin",
    "ReformTimeoutError",
    "SpotRendezvousHandler",
    "Timing",
    "create_handler",
    "register",
]

BACKEND = "spot-etcd"
POLL_S = 0.05
"""How often a node in an open round looks again when no watch event woke it."""
ETCD_TIMEOUT_S = 2.0
"""One etcd request; an unreachable etcd must not hold a heartbeat or the monitor loop."""

_SAY = {
    "joining": "{nodes} waiting to join: re-forming the group",
    "lost": "round {round} lost {nodes}: re-forming the group",
    "unreachable": "round {round}: {nodes} does not answer its probes: re-forming the group",
}


class BadInputAfterJoin(RuntimeError):
    """A worker of this node found input no restart fixes; its log says which."""


class ReformTimeoutError(RendezvousError):
    """A round after the first did not complete within the join timeout. Not 'too few nodes
    could start' (that is the first round's ``RendezvousTimeoutError``): the run stays open."""


def new_node_id() -> str:
    """Unique per agent process: a restarted pod is a new node."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class SpotRendezvousHandler(RendezvousHandler):
    """One agent's membership in the run's rendezvous."""

    def __init__(
        self,
        client: Etcd,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        timing: Timing,
        local_addr: str | None = None,
        verdict: Path | None = None,
        round_file: Path | None = None,
        watch_client: Etcd | None = None,
        prober: Callable[[str, int, str, float], Verdict] | None = None,
    ) -> None:
        self.client, self.run_id, self.timing = client, run_id, timing
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.addr = local_addr or socket.getfqdn()
        self.node = new_node_id()
        self.verdict, self.round_file = verdict, round_file
        self.progress = Progress(timing.stall_timeout_s)
        self.detector = Detector(
            timing.probe_timeout_s, timing.keep_alive_interval_s, POLL_S, self._on_probe, prober
        )
        self.keys = Membership(
            client,
            watch_client or client,
            run_id,
            self.node,
            self.addr,
            timing,
            self.progress,
            saw=self.detector.saw,
        )
        self.root = self.keys.root
        fence_s = timing.ttl_s - self.keys.margin_s
        if fence_s <= self.keys.beat_every_s:
            raise ValueError(
                f"rdzv-conf keep_alive_interval x keep_alive_max_attempt ({timing.ttl_s} s, the "
                f"lease's TTL) must exceed the fence's margin ({self.keys.margin_s:g} s: one "
                f"keep-alive's timeout and etcd's 0.5 s expiry check) by more than one keep-alive "
                f"({self.keys.beat_every_s:g} s); raise keep_alive_max_attempt"
            )
        self.joins = Joins(client, client.another(), self.root, self.keys.notify)
        self.reports = Reports(client, self.root, self.node, lambda: self.keys.lease)
        self.store = RoundStore()
        self.round = 0
        """The round this node last joined (0: none yet)."""
        self._known_index = 0
        self.closing = closing.Closing(self.keys, run_id)
        self.permit = Keeper(
            Permit.of_agent(), lambda: self.keys.in_round(self.round), fence=self.keys.fence
        )
        self.check_stop: Callable[[], None] = lambda: None
        """Raises when the agent was told to stop; called at each monitor poll and each step
        of joining, so a stop whose exception was lost forms no new group (launcher.py)."""

    # -- the interface ---------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """The workers connect to rank 0's store (training/elastic/round_store.py)."""
        return True

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return self.closing.is_closed()

    def set_closed(self) -> None:
        """torch's interface gives no reason: a late node must not take the run for finished."""
        self.closing.close(closing.FAILED, self.round)

    def shutdown(self) -> bool:
        """Nothing: the agent settles it (``settle``); torch's would close on every ending."""
        return True

    def settle(self, close: bool, why: str = closing.FAILED) -> None:
        """Close the rendezvous for good (the run is over: ``why``, training/elastic/closing.py),
        or leave it open for a new pod; either way, leave it."""
        self.closing.settle(close, why, self.round)
        self.leave()

    def leave(self) -> None:
        """Leave for good, at once (training/elastic/membership.py)."""
        self.keys.leave()
        self.store.close()

    def withdraw(self) -> None:
        """Join no round, registered until ``leave`` (training/elastic/membership.py)."""
        self.keys.withdraw()

    def num_nodes_waiting(self) -> int:
        """>0 when the running group must re-form: a new round opened, a node waits to join,
        or a member is gone; or this node's fence passed (no keep-alive answered within the
        lease's TTL less the margin: training/elastic/permit.py). From the watched view, with
        no etcd request: an etcd outage shorter than the fence changes nothing here. Each call
        is the monitor loop's heartbeat (training/elastic/liveness.py: ``Progress``)."""
        self.progress.beat()
        self.check_stop()
        if not self.permit.tick():  # a paused node come back, or fenced (permit.py)
            return 1
        view = self.keys.view
        self.detector.saw_published((view.state or {}).get("probes") or {})
        if view.state_index < self._known_index:
            return 0
        reform = rounds.must_reform(
            view,
            self._me(),
            self.max_nodes,
            lost=lambda n: self._dead(n, view, probe_live=False),
            waiting_dead=lambda n: self._dead(n, view, probe_live=True),
            reached=lambda n: self.detector.reached(n, view.nodes.get(n)),
            unreachable=lambda n: self.detector.unanswered(n, view.nodes.get(n)),
        )
        if reform is None:
            return 0
        if reform.reason in _SAY:
            names = ", ".join(reform.nodes)
            logger.warning(_SAY[reform.reason].format(round=self.round, nodes=names))
        return max(1, len(reform.nodes))

    def next_rendezvous(self) -> RendezvousInfo:
        if self.verdict is not None and self.verdict.exists():
            raise BadInputAfterJoin(
                f"a worker stopped on input no restart fixes: {self.verdict.read_text().strip()}"
            )
        deadline = time.monotonic() + self.timing.join_timeout_s
        opened = 0.0
        # A new round follows a fault: an answer from before it would make this round wait
        # for a node killed since, until the answer ran out.
        self.detector.forget()
        self.joins.drop()
        self.store.close()  # the last round's workers are stopped: its store goes with them
        while True:
            self.progress.beat()
            self.check_stop()
            if self.keys.probe is not None and self.keys.probe.closed:
                # Its port refuses: to every peer this node is gone, so it must not act.
                raise RendezvousGracefulExitError(f"node {self.node} has left {self.run_id}")
            try:
                self.keys.start()
                self.keys.renew_if_fenced()
                seen = self.keys.changes  # a change while this step acts wakes the next at once
                view = self.keys.current_view()
                if time.monotonic() > deadline:
                    raise self._timed_out(view)
                done = self._step(view, opened)
            except EtcdError as exc:
                down = self.keys.note_down(exc)
                if down > self.timing.outage_timeout_s:
                    raise RendezvousConnectionError(
                        f"etcd unreachable for {down:.0f} s during a rendezvous: {exc}"
                    ) from exc
                self.keys.wait_for_change(self.timing.keep_alive_interval_s / 2)
                continue
            self.keys.note_up()
            if isinstance(done, RendezvousInfo):
                return done
            opened = done
            self.keys.wait_for_change(POLL_S, seen)

    # -- one step of joining ------------------------------------------------------------------
    def _me(self) -> Me:
        return Me(self.node, self.round, self.keys.joined_round)

    def _step(self, view: View, opened: float) -> RendezvousInfo | float:
        """Act on the view once: the RendezvousInfo when joined, else when the round opened."""
        quorum = Quorum(self.min_nodes, self.max_nodes, self.timing.last_call_timeout_s)
        state = view.state or {}
        self.detector.saw_published(state.get("probes") or {})
        if state.get("members", ()) is None and not opened:
            opened = time.monotonic()
        self.reports.ask_again(view.nodes, self.detector.reached)  # a healed partition
        reached = lambda n: self.detector.reached(n, view.nodes.get(n))  # noqa: E731
        view = self.joins.for_view(view, self._me(), reached)  # only a completer reads joins
        if self.joins.following:  # it asks about every joiner: side by side, not in turn
            joiners = view.joined.get(self.keys.joined_round, {})
            self.detector.prefetch({n: view.nodes.get(n) for n in joiners if n != self.node})
        dead = lambda n: self._dead(n, view, probe_live=True)  # noqa: E731
        action = rounds.decide(view, self._me(), dead, quorum, opened, time.monotonic(), reached)
        if isinstance(action, rounds.Closed):
            raise self.closing.found(state)
        if isinstance(action, rounds.Member):
            return self._member(action.state, action.index)
        if isinstance(action, rounds.Create):
            self.keys.write_state(action.state, None)
        elif isinstance(action, rounds.Join):
            self.keys.join(action.round)
        elif (
            isinstance(action, rounds.Swap)
            and self.keys.write_state(action.state, action.index)
            and action.completes
        ):
            self.keys.forget_rounds_before(action.state["round"], view)
        return opened

    def _timed_out(self, view: View) -> RendezvousError:
        if rounds.first_round(view.state):
            return RendezvousTimeoutError(
                f"fewer than {self.min_nodes} nodes joined rendezvous {self.run_id} within "
                f"{self.timing.join_timeout_s} s"
            )
        return ReformTimeoutError(
            f"round {(view.state or {}).get('round')} of rendezvous {self.run_id} did not "
            f"complete within {self.timing.join_timeout_s} s (fewer than {self.min_nodes} live "
            "nodes joined it); the run stays open for a new pod"
        )

    def _member(self, state: dict, index: int) -> RendezvousInfo:
        """This node's place in the completed round; rank 0 serves the workers' store."""
        round_, members = int(state["round"]), state["members"]
        self.round, self._known_index = round_, index
        rank, world = members.index(self.node), len(members)
        # Whoever completed this round found every left-out node of the last one dead. An
        # answer this node cached before then would count a just-killed node as waiting and
        # re-form the new group at once: ask again.
        self.detector.forget(set(state.get("previous") or []) - set(members))
        # Rank 0's address and port came with the round: nobody waits in the store for a
        # rank 0 that may have died since the round completed.
        master = state["master"]
        info = RendezvousStoreInfo(master_addr=master["addr"], master_port=int(master["port"]))
        if rank == 0 and (held := self.keys.take_port()) is not None:
            self.store.host(held, info.master_addr, self.timing.store_timeout_s)
        else:
            self.keys.release_port()
        # The agents' own store (torch's exit barrier) is on etcd: no agent waits on rank 0.
        agents = AgentStore(self.client, f"{ROOT}/agents/{self.run_id}/{round_}", 300)
        if self.round_file is not None:
            self.round_file.write_text(json.dumps({"round": round_, "members": world}))
        self.permit.started()
        logger.info(
            "node %s joined round %d of rendezvous %s as rank %d of %d",
            self.node,
            round_,
            self.run_id,
            rank,
            world,
        )
        return RendezvousInfo(agents, rank, world, info)

    def _dead(self, node: str, view: View, probe_live: bool) -> bool:
        return self.detector.dead(node, view.nodes.get(node), probe_live)

    def _on_probe(self, node: str, verdict: Verdict, keyed: bool) -> None:
        """A probe of a fresh key unanswered or refused is a report; answers withdraw it
        (training/elastic/reachability.py)."""
        if verdict is Verdict.ALIVE:
            self.reports.answered(node)
        elif keyed:
            self.reports.file(node, refused=verdict is Verdict.DEAD)


PROTOCOLS = ("http", "https")
TLS_FILES = ("ca_cert", "client_cert", "client_key")


def _client(params: RendezvousParameters, timeout_s: float = ETCD_TIMEOUT_S) -> Etcd:
    """The agent's etcd client from torchrun's parameters: the endpoint first, then every
    member of ``etcd_members`` (``host:port;host:port``) to move on to (etcd_v3.Members);
    ``protocol`` http or https, with ``ca_cert``, ``client_cert`` and ``client_key`` files."""
    protocol = str(params.get("protocol", "http")).strip().lower()
    if protocol not in PROTOCOLS:
        allowed = ", ".join(PROTOCOLS)
        raise ValueError(f"rdzv conf protocol must be one of {allowed}, got {protocol!r}")
    listed = str(params.get(ETCD_MEMBERS, "") or "").split(MEMBERS_SEPARATOR)
    endpoints = [params.endpoint, *(m for m in listed if m.strip())]
    members = Members([parse_endpoint(e, default_port=2379) for e in endpoints])
    tls = Tls(**{k: str(params.get(k)) for k in TLS_FILES if params.get(k)})
    tls.validate()
    for name in TLS_FILES:
        path = getattr(tls, name)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"rdzv conf {name}: {path} is not a file")
    if protocol == "http" and tls != Tls():
        raise ValueError(f"rdzv conf {', '.join(TLS_FILES)} need protocol=https")
    host, port = members.endpoints[0]
    return Etcd(host, port, protocol, timeout_s, members=members, tls=tls)


def create_handler(params: RendezvousParameters) -> SpotRendezvousHandler:
    """The handler for torchrun's parameters (the PET_* env the operator sets)."""
    verdict = os.environ.get(VERDICT_ENV)
    round_file = os.environ.get(ROUND_FILE_ENV)
    client = _client(params)
    handler = SpotRendezvousHandler(
        client,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        Timing.from_params(params),
        local_addr=params.local_addr,
        verdict=Path(verdict) if verdict else None,
        round_file=Path(round_file) if round_file else None,
        watch_client=client.another(),
    )
    return handler


def register() -> str:
    """Register this backend (idempotent); the name to launch with."""
    rendezvous_handler_registry.register(BACKEND, create_handler)
    return BACKEND
