"""The rendezvous' rounds: pure decisions on one view of the run's keys.

No I/O and no clock of its own. The handler (training/elastic/rendezvous.py) reads a ``View``
from etcd (training/elastic/membership.py), asks the failure detector
(training/elastic/liveness.py) through ``dead``, and carries out the one ``Action`` that
``decide`` returns; every write of the state is a transaction that compares the state key's
mod revision with the one in the view, so acting on a stale view only loses a race.

The invariants, whatever the interleaving of joins, leaves and deaths:
- a round completes only with members that joined it, have not left, and whose probe the
  completer itself saw answered (a joiner lost before completion is left out, and so is not a
  rank the others wait for; one it cannot reach holds the round until the reports decide); the
  first node of the round's order that this node reaches completes it;
- a node cut off from its peers, but not from etcd, is left out: every node files a report for
  a peer whose probe goes unanswered while its key is fresh, and ``excluded`` takes out of the
  round, one at a time, the node with the most broken links (a tie: the latest in the order),
  so the side that reaches each other trains on (docs/rendezvous.md, "A partition");
- a round waits for every node it expects (the last round's members and every live registered
  node) until each has joined or is dead, so two groups never train at once;
- the previous members keep their order, so rank 0 (the durable committer) stays where it was;
- only the run's first round may end in "too few nodes" (``first_round``): a later round that
  cannot complete leaves the run open.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field, fields
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters

from training.elastic.launch import RendezvousSettings
from training.elastic.liveness import PROBE_TIMEOUT_S

_DEFAULTS = RendezvousSettings()


@dataclass(frozen=True)
class Timing:
    """The rendezvous' clocks: torchrun's ``--rdzv-conf`` keys, each the name without ``_s``
    (``RendezvousSettings`` in training/elastic/launch.py writes them and gives the defaults)."""

    keep_alive_interval_s: int = _DEFAULTS.keep_alive_interval_s
    keep_alive_max_attempt: int = _DEFAULTS.keep_alive_max_attempt
    last_call_timeout_s: int = _DEFAULTS.last_call_timeout_s
    join_timeout_s: int = _DEFAULTS.join_timeout_s
    probe_timeout_s: float = PROBE_TIMEOUT_S
    outage_timeout_s: int = 60
    """A round that cannot reach etcd for this long gives up (RendezvousConnectionError: the
    agent exits 138 and the operator makes a new pod). Between rounds an outage costs
    nothing."""
    stall_timeout_s: float = 60.0
    """An agent whose own loop (the monitor loop, a round) made no progress for this long is
    wedged: its probe stops answering 'alive' and its key is left to expire, as a frozen
    node's. Twice the 30 s torch's agent may spend stopping its workers
    (``LocalElasticAgent._stop_workers``), the longest its loop is legitimately away."""
    store_timeout_s: float = 300.0
    """The workers' store's own timeout for a key it waits for (torch's TCPStore default);
    the workers' process-group start is bounded by their collective timeout anyway."""

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
    """Registered nodes (their keys live while they beat): address, probe port, ``left``."""
    joined: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """Per round, the nodes that joined it in the order they did, each with the address and
    port its workers' store would listen on were it rank 0."""
    reports: dict[str, set[str]] = field(default_factory=dict)
    """Per reporter, the nodes whose probe it could not get answered while their key was fresh
    (training/elastic/reachability.py)."""
    refused: set[tuple[str, str]] = field(default_factory=set)
    """The reports whose probe was refused, as (reporter, target)."""
    etcd_index: int = 0
    read_at: float = 0.0


@dataclass(frozen=True)
class Quorum:
    """The round's size rules: torchrun's ``--nnodes=min:max`` and the first round's last call."""

    min_nodes: int
    max_nodes: int
    last_call_s: float


@dataclass(frozen=True)
class Me:
    """This node's place: its id, the round it last joined and the one it wrote a join key for."""

    node: str
    round: int = 0
    joined_round: int = 0


# -- what to do next ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Create:
    """No state yet: create round 1 (only if still absent)."""

    state: dict[str, Any]


@dataclass(frozen=True)
class Swap:
    """Replace the state read at ``index`` (open the next round, or complete this one)."""

    state: dict[str, Any]
    index: int
    completes: bool = False


@dataclass(frozen=True)
class Join:
    """Write this node's join key for ``round``."""

    round: int


@dataclass(frozen=True)
class Member:
    """This node is a member of the completed ``state``: hand the round to the agent."""

    state: dict[str, Any]
    index: int


@dataclass(frozen=True)
class Closed:
    """The run is over for good."""


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the view changes."""


Action = Create | Swap | Join | Member | Closed | Wait
Dead = Callable[[str], bool]
"""Whether a node is lost (left, or its process gone), probing it if need be."""
Reached = Callable[[str], bool]
"""Whether this node's own probe of a node was answered (now, or within the answer's hold);
one that goes unanswered while the node's key is fresh is reported."""


def excluded(
    order: list[str],
    reports: dict[str, set[str]],
    refused: Collection[tuple[str, str]] = (),
) -> set[str]:
    """The nodes of ``order`` the reports leave out, so that the rest reach each other.

    A link is broken when either end reported the other. The node with the most broken links
    goes first (the one cut off: the others report it, and it reports them all), then the next,
    until no broken link is left among the rest; a tie takes the one refused most (a one-way
    REJECT, a killed node: refused, refusing no one; a silent link is judged by its order
    alone, whichever end reported first), then the latest in the order, so the
    previous members, and rank 0 first, keep their places. Every node computes the same set
    from the same keys, so they agree on who completes the round.
    """
    among = set(order)
    broken = {
        frozenset((reporter, target))
        for reporter, targets in reports.items()
        if reporter in among
        for target in targets
        if target in among and target != reporter
    }
    reported = {(r, t) for r, t in refused if r in among and t in among and r != t}
    out: set[str] = set()
    while broken:
        degree: dict[str, int] = {}
        for link in broken:
            for node in link:
                degree[node] = degree.get(node, 0) + 1
        blamed = {n: sum(1 for r, t in reported if t == n and r not in out) for n in degree}
        worst = max(degree, key=lambda n: (degree[n], blamed[n], order.index(n)))
        out.add(worst)
        broken = {link for link in broken if worst not in link}
    return out


def first_round(state: dict[str, Any] | None) -> bool:
    """The run's first round is forming: no group has trained yet."""
    return state is None or (int(state["round"]) <= 1 and state.get("members") is None)


def decide(
    view: View,
    me: Me,
    dead: Dead,
    quorum: Quorum,
    opened: float,
    now: float,
    reached: Reached | None = None,
) -> Action:
    """The next step of joining, from one view; ``opened``: when this node saw the round open.

    ``reached`` (default: not ``dead``) says whether this node's own probe of a node was
    answered; a round completes only with joiners it says so of."""
    reach = reached or (lambda n: not dead(n))
    state, index = view.state, view.state_index
    if state is None:
        return Create({"round": me.round + 1, "members": None, "previous": []})
    if state.get("closed"):
        return Closed()
    round_, members = int(state["round"]), state.get("members")
    if members is not None:
        if me.node in members and round_ > me.round:
            return Member(state, index)
        if me.node in members or (members and all(dead(m) for m in members)):
            # This node left round_ (its workers stopped), or every member is gone: round_
            # is over for everyone, the next one opens.
            nxt = {"round": max(round_, me.round) + 1, "members": None, "previous": members}
            return Swap(nxt, index)
        return Wait()  # a new node: the members see it waiting and re-form
    if me.joined_round != round_:
        return Join(round_)
    joined = view.joined.get(round_, {})
    previous = state.get("previous") or []
    everyone = [n for n in previous if n in joined] + [n for n in joined if n not in previous]
    cut = excluded(everyone, view.reports, view.refused)
    # A node the round expects that did not join holds it up, unless the same reports leave it
    # out and its probe was refused: a killed node with a fresh key, refused by every peer.
    # One order for all (the previous members first), so every node frees the same.
    waited = [n for n in _expected(previous, view) if n not in everyone and not dead(n)]
    canon = [n for n in previous if n in everyone or n in waited]
    canon += [n for n in everyone if n not in previous]
    canon += sorted(n for n in waited if n not in previous)
    refused = {target for _, target in view.refused}
    freed = excluded(canon, view.reports, view.refused) & set(waited) & refused
    if me.node in cut:
        return Wait()  # the others cannot reach this node (or it them): they go on without it
    order = [n for n in everyone if n not in cut]
    if not _may_complete(order, everyone, previous, view, dead, quorum, now - opened, cut | freed):
        return Wait()
    # One node completes the round: the first of its order it reaches itself. It alone asks
    # about every joiner, so a re-form costs each node one probe, not one per joiner.
    if next((n for n in order if n == me.node or reach(n)), None) != me.node:
        return Wait()
    # Only joiners whose probe this node saw answered become members. One lost since it joined
    # (a second eviction while the group re-forms) is left out; one it cannot reach although
    # it lives holds the round until the reports filed meanwhile leave one side out.
    alive = [n for n in order if n == me.node or reach(n)]
    if any(n not in alive and not dead(n) for n in order):
        return Wait()
    if alive != order and not _may_complete(
        alive, everyone, previous, view, dead, quorum, now - opened, cut | freed
    ):
        return Wait()
    chosen = alive[: quorum.max_nodes]
    # Where each member answers probes: a node that never saw a member's key (it expired
    # first) asks there before it counts the member as gone (liveness.py, ``saw_published``).
    probes = {
        n: {"addr": view.nodes[n]["addr"], "port": view.nodes[n]["port"]}
        for n in chosen
        if n in view.nodes
    }
    done = {
        "round": round_,
        "members": chosen,
        "previous": previous,
        "master": joined[chosen[0]],
        "probes": probes,
    }
    return Swap(done, index, completes=True)


def _expected(previous: list[str], view: View) -> set[str]:
    """The nodes a round waits for: the last round's members and every live registered node."""
    return set(previous) | {n for n, info in view.nodes.items() if not info["left"]}


def _may_complete(
    joiners: list[str],
    joined: list[str],
    previous: list[str],
    view: View,
    dead: Dead,
    quorum: Quorum,
    open_for_s: float,
    cut: Collection[str] = (),
) -> bool:
    """``joiners``: the candidates for members; ``joined``: every node that joined, the
    excluded ones too (a node the round waits for has joined once it wrote its key); ``cut``:
    the nodes the reports leave out, waited for by no one."""
    if len(joiners) < quorum.min_nodes:
        return False
    if len(joiners) >= quorum.max_nodes:
        return True
    if any(n not in joined and n not in cut and not dead(n) for n in _expected(previous, view)):
        return False
    # A group that starts afresh (the first round, or none of the last round's members
    # survived) waits a last call for nodes that have not even registered yet.
    afresh = not any(n in joiners for n in previous)
    return not afresh or open_for_s >= quorum.last_call_s


def needs_joins(view: View, me: Me, reached: Reached, head: Callable[[], list[str]]) -> bool:
    """Whether this node may be the one to complete the open round it joined, and so must
    follow every join (training/elastic/rendezvous.py reads them only then).

    The first node of the round's order that it reaches completes the round. A node ahead of
    this one in the order that it reaches, and that no report names, completes the round or
    holds it (the round waits for every live previous member to join): this node then waits
    without the joins, so a round's N joins go to one watcher instead of N. The previous
    members come first, in their order, then the other joiners in the order they joined
    (``head``: the first of them, asked only when no previous member serves). Waiting on
    fewer joins than there are only delays a round: it completes once every node it expects
    joined or is dead, and ``decide`` counts only joins it was given.
    """
    state = view.state
    if state is None or state.get("members") is not None or me.joined_round != state["round"]:
        return False
    previous = list(state.get("previous") or [])
    named = {n for reporter, targets in view.reports.items() for n in (reporter, *targets)}

    def serves(node: str) -> bool:
        return node != me.node and node not in named and reached(node)

    if me.node in previous:
        return not any(serves(n) for n in previous[: previous.index(me.node)])
    if any(serves(n) for n in previous):
        return False
    first = head()
    return not any(
        serves(n) for n in (first[: first.index(me.node)] if me.node in first else first)
    )


@dataclass(frozen=True)
class Reform:
    """Why the running group must re-form, and the nodes that make it so."""

    reason: str
    """``round``: a new round opened; ``joining``: nodes wait to join; ``lost``: members gone;
    ``unreachable``: this node's probes get no connection to the next member in the order."""
    nodes: tuple[str, ...] = ()


def must_reform(
    view: View,
    me: Me,
    max_nodes: int,
    lost: Dead,
    waiting_dead: Dead,
    reached: Reached | None = None,
    unreachable: Dead | None = None,
) -> Reform | None:
    """Whether this node's running group must re-form (the agent's ``num_nodes_waiting``).

    ``lost`` judges a member cheaply (its key, its held answer); ``waiting_dead`` probes a
    registered non-member, whose key outlives a killed node by up to a TTL. A non-member waits
    to join only once this node reaches it and the reports would not leave it out again: a
    node cut off from the group is no reason to re-form until the partition heals.

    ``unreachable`` probes one member, the next after this node in the order (a ring: every
    member is watched by one peer, at one probe per node per heartbeat period), and says
    whether its probes get no connection while its key is fresh (a partition, not a frozen
    process): the group then re-forms before the workers' collective times out, which would
    spend a restart on every node.
    """
    reach = reached or (lambda n: not waiting_dead(n))
    state = view.state
    if state is None or not me.round:
        return None
    if state.get("round", 0) != me.round or state.get("members") is None:
        return Reform("round")
    members = state["members"]
    if len(members) < max_nodes:
        waiting = tuple(
            n
            for n in view.nodes
            if n not in members
            and not waiting_dead(n)
            and reach(n)
            and n not in excluded([*members, n], view.reports, view.refused)
        )
        if waiting:
            return Reform("joining", waiting)
    gone = tuple(m for m in members if m != me.node and lost(m))
    if gone:
        return Reform("lost", gone)
    if unreachable is not None and me.node in members and len(members) > 1:
        watched = members[(members.index(me.node) + 1) % len(members)]
        if unreachable(watched):
            return Reform("unreachable", (watched,))
    return None
