"""A chaos schedule: faults that overlap, drawn at random from a seed (pure, no I/O).

Each fault waits ``gap_s`` (0 to 3 s) after the previous one, whether or not the job settled,
so faults land while the group re-forms, saves and restores. A schedule is a function of its
seed and the plan alone: ``--seed S --schedules 1`` draws it again. Which node a fault hits is
drawn too (``pick``, a fraction of the live nodes in name order), and resolved when it runs.

The kinds and their parameters come from one stream of the seed, drawn as before the paused
VMs that come back (``thaw``, ``thaw-upload``) and the nodes with several processes were
added; those come from a second stream of the same seed (``_extra``): a drawn ``freeze`` stays
one, or becomes a ``thaw`` or a ``thaw-upload``, and the schedule's processes per node are
drawn from the plan's choices. So an old seed still draws its old faults, at the same times,
on the same nodes; only some of its freezes now come back.

A ``partition`` comes from the second stream too, after all of its earlier draws: in some
schedules (``PARTITION_SHARE``) it is put between two faults of the first stream, at a point
where at least two nodes are expected to run, its gap carved out of the next fault's, so every
other fault keeps its time. An ``etcd-cut`` is put in the same way from a third stream
(``ETCD_CUT_SHARE``), after the partition: every earlier draw of a seed stays as it was.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Any

NODE_FAULTS = ("evict", "kill", "freeze")
"""Hit one live node: SIGTERM (then SIGKILL after the grace), SIGKILL, SIGSTOP (a VM gone
without an RST; it is deleted, SIGKILL, ``seconds`` later)."""
TRIGGERED = ("sigterm-restore", "sigterm-upload")
"""Armed at their turn, they SIGTERM a node when it reaches the moment they name: a worker
starting a new round (its restore, slowed down by the store), or a checkpoint upload (slowed
down too). One that finds no such moment within ``ARM_S`` is recorded as not landed."""
STORE_FAULTS = ("store-slow", "store-fail")
"""The durable store answers every call ``delay_s`` late, or fails every call, for
``seconds`` (bench/chaos/faulty_store.py)."""
THAWS = ("thaw", "thaw-upload")
"""A paused VM that comes back: SIGSTOP the node's whole tree, and SIGCONT it ``thaw_s`` after
the group re-formed without it (and no sooner than ``seconds`` after the freeze); until then
it keeps its place (no new node takes it). ``thaw-upload`` is armed like ``sigterm-upload``
(uploads slowed by ``delay_s``) and freezes the node that starts one: a zombie writer that
finishes its upload after the others moved on."""
DRAWN = (*NODE_FAULTS, "join", "etcd", "evict-all", *TRIGGERED, *STORE_FAULTS)
"""The kinds the first stream draws from (its order is part of every old seed's schedule).
``join`` starts a new node; ``etcd`` stops etcd for ``seconds``; ``evict-all`` evicts every
live node and starts ``nodes`` new ones ``seconds`` later."""
PARTITION = "partition"
"""A node cut off from its peers (not from etcd, nor the durable store) for ``seconds``, then
healed: a blackhole route to every peer in its network namespace (lab/local/netns.py). It
stays a live node: the rendezvous leaves it out without a restart, and takes it back."""
ETCD_CUT = "etcd-cut"
"""``nodes`` nodes (from the one ``pick`` names, in name order) cut off from etcd, not from their
peers nor the store, for ``seconds``, then healed: a blackhole route to the host's address,
where etcd listens, in each one's namespace (lab/local/netns.py). With ``join`` a new node
starts as they are cut (when the job has room): the case in which a group cut off from etcd
trained on beside the round the new node opened. A cut node must stop at its fence and never
train beside another group."""
NETWORK_FAULTS = (PARTITION, ETCD_CUT)
"""The kinds that need every node in a network namespace."""
KINDS = (*DRAWN, *THAWS, *NETWORK_FAULTS)
PARTITION_SHARE = 0.4
"""The share of schedules that hold a partition."""
PARTITION_S = (3.0, 15.0)
ETCD_CUT_SHARE = 0.3
"""The share of schedules that hold an etcd-cut."""
ETCD_CUT_S = (3.0, 12.0)
MAX_GAP_S = 3.0
ARM_S = 12.0
MAX_THAW_S = 6.0


@dataclass(frozen=True)
class ChaosFault:
    """One fault of a schedule."""

    kind: str
    gap_s: float
    """Seconds after the previous fault (0 to MAX_GAP_S)."""
    pick: float = 0.0
    """Which live node, as a fraction of the live nodes in name order."""
    seconds: float = 0.0
    """etcd: down; freeze: frozen until deleted; evict-all: until the new nodes start; store
    faults and the triggered ones: how long the store misbehaves; partition: until healed."""
    delay_s: float = 0.0
    """store-slow and the triggered faults: the store's delay per call."""
    nodes: int = 0
    """evict-all: new nodes that start after it."""
    thaw_s: float = 0.0
    """thaw, thaw-upload: seconds after the group re-formed without the node, to its SIGCONT."""
    join: bool = False
    """etcd-cut: a new node starts as the nodes are cut."""

    def describe(self) -> str:
        """Short text, e.g. ``+1.2s evict`` or ``+0.0s store-slow 0.4s/call for 5.0s``."""
        detail = {
            "freeze": f" for {self.seconds:.1f}s",
            "etcd": f" down {self.seconds:.1f}s",
            "evict-all": f", {self.nodes} new after {self.seconds:.1f}s",
            "store-slow": f" {self.delay_s:.1f}s/call for {self.seconds:.1f}s",
            "store-fail": f" for {self.seconds:.1f}s",
            "sigterm-restore": f" (store {self.delay_s:.1f}s/read)",
            "sigterm-upload": f" (store {self.delay_s:.1f}s/upload)",
            "thaw": f" {self.thaw_s:.1f}s after the re-form (>= {self.seconds:.1f}s)",
            "thaw-upload": f" (store {self.delay_s:.1f}s/upload), {self.thaw_s:.1f}s after",
            "partition": f" for {self.seconds:.1f}s",
            ETCD_CUT: f" of {self.nodes} node(s) for {self.seconds:.1f}s"
            + (", a new node with it" if self.join else ""),
        }.get(self.kind, "")
        return f"+{self.gap_s:.1f}s {self.kind}{detail}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Schedule:
    seed: int
    faults: tuple[ChaosFault, ...]
    nproc_per_node: int = 1
    """Training processes on every node of this schedule."""

    def describe(self) -> str:
        text = ", ".join(f.describe() for f in self.faults)
        return text if self.nproc_per_node == 1 else f"[{self.nproc_per_node} procs] {text}"


def _kinds_for(live: int, max_nodes: int) -> list[str]:
    """The kinds that make sense with ``live`` nodes expected to run."""
    if live == 0:
        return ["join"]  # nothing to hit: capacity comes back first
    kinds = [k for k in DRAWN if k != "join" or live < max_nodes]
    return kinds


def draw_fault(rng: random.Random, kind: str, max_nodes: int, gap_s: float) -> ChaosFault:
    """One fault of ``kind`` with its parameters drawn from ``rng``."""
    pick = rng.random()
    if kind == "freeze":
        return ChaosFault(kind, gap_s, pick, seconds=rng.uniform(2.0, 8.0))
    if kind == "etcd":
        return ChaosFault(kind, gap_s, pick, seconds=rng.uniform(0.5, 5.0))
    if kind == "evict-all":
        new = rng.randint(1, max_nodes)
        return ChaosFault(kind, gap_s, pick, seconds=rng.uniform(0.0, MAX_GAP_S), nodes=new)
    if kind == "store-slow":
        return ChaosFault(
            kind, gap_s, pick, seconds=rng.uniform(2.0, 8.0), delay_s=rng.uniform(0.1, 1.0)
        )
    if kind == "store-fail":
        return ChaosFault(kind, gap_s, pick, seconds=rng.uniform(0.5, 6.0))
    if kind in TRIGGERED:
        return ChaosFault(kind, gap_s, pick, seconds=ARM_S, delay_s=rng.uniform(0.5, 1.5))
    return ChaosFault(kind, gap_s, pick)


def _extra(seed: int) -> random.Random:
    """The seed's second stream: the draws added after the first (see the module's note)."""
    return random.Random(f"chaos-extra-{seed}")


def _etcd_cuts(seed: int) -> random.Random:
    """The seed's third stream: the etcd-cut, added after the partition."""
    return random.Random(f"chaos-etcd-cut-{seed}")


def _maybe_thaw(extra: random.Random, fault: ChaosFault) -> ChaosFault:
    """A drawn freeze stays one (a third of them), or comes back: a thaw, a thaw-upload."""
    if fault.kind != "freeze":
        return fault
    roll, thaw_s = extra.random(), round(extra.uniform(0.0, MAX_THAW_S), 2)
    if roll < 1 / 3:
        return fault
    if roll < 2 / 3:
        return replace(fault, kind="thaw", thaw_s=thaw_s)
    delay = extra.uniform(1.0, 2.5)  # an upload of several slowed calls: long enough to hit
    return replace(fault, kind="thaw-upload", seconds=ARM_S, delay_s=delay, thaw_s=thaw_s)


def _live_after(fault: ChaosFault, live: int) -> int:
    if fault.kind in (*NODE_FAULTS, *TRIGGERED, *THAWS):
        return live - 1
    if fault.kind == "join":
        return live + 1
    if fault.kind == "evict-all":
        return fault.nodes
    return live


def random_schedule(
    seed: int,
    nodes: int,
    faults: tuple[int, int],
    nprocs: tuple[int, ...] = (1,),
    partitions: bool = True,
) -> Schedule:
    """The schedule of ``seed``: between ``faults[0]`` and ``faults[1]`` faults on a job of
    ``nodes`` nodes (also its most), each ``0 <= gap_s <= MAX_GAP_S`` after the last, with one
    of ``nprocs`` processes per node. A thaw counts as a node lost (it may not come back in
    time), as the freeze it was drawn as. ``partitions=False`` leaves the partition out (it
    needs network namespaces); every other fault is drawn as with it."""
    rng, extra = random.Random(seed), _extra(seed)
    nproc = extra.choice(nprocs)
    count = rng.randint(*faults)
    live, drawn, lives = nodes, [], []
    for _ in range(count):
        lives.append(live)
        kind = rng.choice(_kinds_for(live, nodes))
        fault = draw_fault(rng, kind, nodes, round(rng.uniform(0.0, MAX_GAP_S), 2))
        live = _live_after(fault, live)
        drawn.append(_maybe_thaw(extra, fault))
    lives.append(live)
    if not partitions:
        return Schedule(seed, tuple(drawn), nproc)
    faults, lives = _maybe_insert(extra, drawn, lives, PARTITION, PARTITION_SHARE, PARTITION_S, 2)
    faults, _ = _maybe_insert(
        _etcd_cuts(seed), faults, lives, ETCD_CUT, ETCD_CUT_SHARE, ETCD_CUT_S, 1
    )
    return Schedule(seed, tuple(faults), nproc)


def _maybe_insert(
    rng: random.Random,
    drawn: list[ChaosFault],
    lives: list[int],
    kind: str,
    share: float,
    seconds_range: tuple[float, float],
    least: int,
) -> tuple[list[ChaosFault], list[int]]:
    """``drawn`` with a fault of ``kind`` put in before fault ``i`` (``len(drawn)``: after the
    last) where ``lives[i]`` nodes are expected to run, at least ``least``, in ``share`` of the
    schedules; and ``lives`` to match. Its gap is a share of fault ``i``'s, which keeps the
    rest (so every other fault runs when it did). An etcd-cut also draws how many nodes it
    cuts (1 up to every one expected to run) and whether a new node starts with it."""
    roll, where, part = rng.random(), rng.random(), rng.random()
    seconds, pick = round(rng.uniform(*seconds_range), 2), rng.random()
    places = [i for i, live in enumerate(lives) if live >= least]
    if roll >= share or not places:
        return list(drawn), list(lives)
    at = places[min(int(where * len(places)), len(places) - 1)]
    faults = list(drawn)
    if at < len(faults):
        gap = round(faults[at].gap_s * part, 2)
        faults[at] = replace(faults[at], gap_s=round(faults[at].gap_s - gap, 2))
    else:
        gap = round(part * MAX_GAP_S, 2)
    fault = ChaosFault(kind, gap, pick, seconds=seconds)
    if kind == ETCD_CUT:
        nodes = 1 + min(int(rng.random() * lives[at]), lives[at] - 1)
        fault = replace(fault, nodes=nodes, join=rng.random() < 0.5)
    faults.insert(at, fault)
    return faults, [*lives[:at], lives[at], *lives[at:]]
