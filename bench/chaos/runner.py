"""One chaos schedule against live nodes, on the lab's own runner (``lab/local/runner.py``).

The lab's ``FaultRunner`` starts the nodes, reads their records, restarts a node whose agent
exits on its own (as the kubelet would) and ends when training finishes. This runner replaces
only when faults happen: once the job trains at full size, each fault of the schedule runs
``gap_s`` after the previous one, settled or not; a triggered fault waits for its moment (a
worker starting a round, an upload starting). When the schedule is done, the capacity comes
back: new nodes start until the job has its nodes again, and training runs to its end.

A thawed node (``thaw``, ``thaw-upload``) is a paused VM that comes back: frozen, it keeps its
place (no new node takes it, as its pod is not replaced while its VM may return), and once a
group re-formed without it (a worker of another node started after the freeze) it gets
SIGCONT ``thaw_s`` later and is a live node again, whatever it then does.

A partitioned node (``partition``) stays a live node: a blackhole route to every peer in its
network namespace (``lab/local/netns.py``) cuts it off from them, not from etcd or the store,
and ``seconds`` later the routes go (``healed``). Nothing is sent to its processes. An
``etcd-cut`` is the other way round: its nodes lose etcd (a blackhole route to the host's
address) and keep their peers, and a new node may start as they are cut.

Everything it does is logged (``actions``, and ``chaos_fault`` lines in the lab's event log)
for the invariants (``bench/chaos/invariants.py``). After each durable acknowledgement in the
records it checks the store at once: the newest checkpoint that verifies must be at least
that step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos.schedule import ETCD_CUT, ChaosFault, Schedule
from lab.local.etcd_server import EmbeddedEtcd
from lab.local.netns import Network
from lab.local.node import wait_for_exit
from lab.local.runner import FaultRunner, RunOutcome, _FollowUp
from lab.report.node_logs import LogTail
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.storage import FileStore
from training.records import STARTED, Record, acknowledged_step

TOP_UP_AFTER_S = 3.0
"""After the last fault (and what it set off), how long before the capacity comes back."""
THAW_WAIT_S = 40.0
"""A frozen node that no group re-formed without (it was the last one, or the others could
not re-form) comes back this long after its freeze anyway."""


class StoreControl:
    """The windows of trouble the workers' durable store reads (bench/chaos/faulty_store.py),
    and the nodes' logs of the calls that met them."""

    def __init__(self, control: Path, logs: Path) -> None:
        self.control, self.logs = control, logs
        control.parent.mkdir(parents=True, exist_ok=True)
        control.touch()
        logs.mkdir(parents=True, exist_ok=True)
        self._tails: dict[int, LogTail] = {}

    def log_of(self, number: int) -> Path:
        return self.logs / f"node-{number}.jsonl"

    def open(
        self, seconds: float, delay_s: float = 0.0, fail: bool = False, ops: Any = None
    ) -> None:
        """From now, for ``seconds``: every call (or only ``ops``) waits or fails."""
        now = time.time()
        window = {"from": now, "until": now + seconds, "delay_s": delay_s, "fail": fail}
        if ops is not None:
            window["ops"] = list(ops)
        with open(self.control, "a") as f:
            f.write(json.dumps(window) + "\n")

    def uploads(self) -> list[tuple[int, dict]]:
        """(node, line) of every upload that started since the last call."""
        found = []
        for path in self.logs.glob("node-*.jsonl"):
            number = int(path.stem.removeprefix("node-"))
            tail = self._tails.setdefault(number, LogTail(path))
            for line in tail.read_lines():
                if line.strip():
                    entry = json.loads(line)
                    if entry["what"] == "upload":
                        found.append((number, entry))
        return found


@dataclass
class Armed:
    """A triggered fault waiting for its moment."""

    index: int
    fault: ChaosFault
    since: float
    """time.time() when armed: only a moment after it counts."""
    until: float
    """time.monotonic() when it gives up."""


@dataclass
class Paused:
    """A frozen node that will come back."""

    index: int
    fault: ChaosFault
    since: float
    """time.time() of its SIGSTOP."""
    earliest: float
    """time.monotonic() before which it stays frozen."""
    give_up: float
    """time.monotonic() when it comes back even if no group re-formed without it."""
    reformed: float | None = None
    """time.monotonic() when a worker of another node started after the freeze."""


@dataclass
class ChaosRunner(FaultRunner):
    """``FaultRunner`` with the schedule's overlapping faults in place of the scenario's."""

    schedule: Schedule | None = None
    etcd: EmbeddedEtcd | None = None
    store: StoreControl | None = None
    checkpoints: Path | None = None
    grace_s: float = 13.0
    """An evicted node gets SIGKILL this long after its SIGTERM (the pod's termination grace)."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    ack_checks: list[dict[str, Any]] = field(default_factory=list)
    _warm: bool = False
    _index: int = 0
    _last: float = 0.0
    _starts: list[tuple[float, int]] = field(default_factory=list)
    _etcd_back: float | None = None
    _armed: list[Armed] = field(default_factory=list)
    _topped_up: bool = False
    _paused: dict[int, Paused] = field(default_factory=dict)
    network: Network | None = None
    """The nodes' network, when the schedule holds a partition or an etcd-cut."""
    _heals: list[tuple[float, int, int, str]] = field(default_factory=list)
    """(time.monotonic() due, node, fault index, kind) of every cut still to heal."""

    # -- the schedule's clock ---------------------------------------------------------------
    def _maybe_inject(self) -> None:
        if not self._warm:
            if self._settle_world is not None:
                return  # not yet training at full size
            self._warm, self._last = True, time.monotonic()
            self._act(-1, "warm", [])
        now = time.monotonic()
        self._due_starts(now)
        self._fire_uploads()
        self._expire(now)
        self._thaw_due(now)
        self._heal_due(now)
        faults = self.schedule.faults if self.schedule else ()
        if self._index < len(faults) and now >= self._last + faults[self._index].gap_s:
            self._run(self._index, faults[self._index])
            self._index, self._last = self._index + 1, time.monotonic()
        elif self._done_with_faults() and now >= self._last + TOP_UP_AFTER_S:
            self._top_up()

    def _done_with_faults(self) -> bool:
        faults = self.schedule.faults if self.schedule else ()
        return (
            self._index >= len(faults)
            and not self._starts
            and self._etcd_back is None
            and not self._armed
            and not self._paused
            and not self._heals
        )

    def _nodes_expected(self) -> bool:
        return super()._nodes_expected() or not (self._done_with_faults() and self._topped_up)

    def _top_up(self) -> None:
        if self._topped_up:
            return
        self._topped_up = True
        started = [self._start_new() for _ in range(self.scenario.nodes - len(self.live))]
        self._act(-1, "capacity back", started)

    def _due_starts(self, now: float) -> None:
        for due, count in [s for s in self._starts if s[0] <= now]:
            self._starts.remove((due, count))
            room = self.scenario.max_nodes - len(self.live) - len(self._paused)
            self._act(-1, "new nodes", [self._start_new() for _ in range(min(count, room))])
        if self._etcd_back is not None and now >= self._etcd_back and self.etcd is not None:
            self._etcd_back = None
            self.etcd.start()
            self._act(-1, "etcd back", [])

    # -- faults -----------------------------------------------------------------------------
    def _run(self, index: int, fault: ChaosFault) -> None:
        kind = fault.kind
        if kind in ("evict", "kill", "freeze", "thaw"):
            target = self._pick(fault)
            if target is None:
                self._act(index, kind, [], landed=False, why="no live node")
                return
            if kind == "thaw":
                self._pause(target, fault, index)
            else:
                {"evict": self._evict, "kill": self._kill, "freeze": self._freeze}[kind](
                    target, fault
                )
            self._act(index, kind, [self.nodes[target].name])
        elif kind in ("partition", ETCD_CUT):
            self._cut(index, fault)
        elif kind == "join":
            if len(self.live) + len(self._paused) >= self.scenario.max_nodes:
                self._act(index, kind, [], landed=False, why="max nodes run")
                return
            self._act(index, kind, [self._start_new()])
        elif kind == "evict-all":
            targets = sorted(self.live)
            for target in targets:
                self._evict(target, fault)
            self._starts.append((time.monotonic() + fault.seconds, fault.nodes))
            self._act(index, kind, [self.nodes[t].name for t in targets], new=fault.nodes)
        else:
            self._run_other(index, fault)

    def _run_other(self, index: int, fault: ChaosFault) -> None:
        """etcd and store faults; their windows (``seconds``, ``delay_s``) go in the action:
        the invariants read them (a store that refused a whole deadline excuses a loss)."""
        assert self.store is not None
        window = {"seconds": fault.seconds, "delay_s": fault.delay_s}
        if fault.kind == "etcd":
            back = time.monotonic() + fault.seconds
            if self._etcd_back is None and self.etcd is not None:
                self.etcd.stop()
            self._etcd_back = max(back, self._etcd_back or back)
        elif fault.kind == "store-slow":
            self.store.open(fault.seconds, delay_s=fault.delay_s)
        elif fault.kind == "store-fail":
            self.store.open(fault.seconds, fail=True)
        elif fault.kind == "sigterm-restore":  # the new round's reads of the store, slowed
            self.store.open(fault.seconds, delay_s=fault.delay_s, ops=("get", "list"))
            self._arm(index, fault)
            return
        elif fault.kind in ("sigterm-upload", "thaw-upload"):
            self.store.open(fault.seconds, delay_s=fault.delay_s, ops=("put",))
            self._arm(index, fault)
            return
        self._act(index, fault.kind, [], **window)

    def _pick(self, fault: ChaosFault) -> int | None:
        live = sorted(self.live)
        return live[min(int(fault.pick * len(live)), len(live) - 1)] if live else None

    def _evict(self, number: int, fault: ChaosFault) -> None:
        self._stopped(number)
        self.nodes[number].notify_eviction()
        self._follow_ups.append(_FollowUp(time.monotonic() + self.grace_s, "kill", number))

    def _kill(self, number: int, fault: ChaosFault) -> None:
        self._stopped(number)
        self.nodes[number].kill()

    def _freeze(self, number: int, fault: ChaosFault) -> None:
        self._stopped(number)
        self.nodes[number].freeze()
        self._follow_ups.append(_FollowUp(time.monotonic() + fault.seconds, "kill", number))

    def _pause(self, number: int, fault: ChaosFault, index: int) -> None:
        self._stopped(number)
        self.nodes[number].freeze()
        now = time.monotonic()
        wait = fault.seconds if fault.kind == "thaw" else 0.0
        self._paused[number] = Paused(index, fault, time.time(), now + wait, now + THAW_WAIT_S)

    def _thaw_due(self, now: float) -> None:
        for number, paused in list(self._paused.items()):
            ready = paused.reformed is not None and now >= max(
                paused.reformed + paused.fault.thaw_s, paused.earliest
            )
            if not ready and now < paused.give_up:
                continue
            del self._paused[number]
            self.nodes[number].thaw()
            self.live.add(number)  # whatever it does now, the lab sees (and restarts) it
            self._act(
                paused.index,
                "thawed",
                [self.nodes[number].name],
                landed=True,
                reformed=ready,
                of=paused.fault.kind,
            )

    def _cut(self, index: int, fault: ChaosFault) -> None:
        """A partition cuts one live node off from its peers; an etcd-cut ``fault.nodes`` of
        them (from the one ``pick`` names, in name order) off from etcd, and may start a node."""
        target = self._pick(fault)
        if target is None or self.network is None:
            why = "no live node" if target is None else "no network namespaces"
            self._act(index, fault.kind, [], landed=False, why=why)
            return
        live = sorted(self.live)
        first = live.index(target)
        count = fault.nodes if fault.kind == ETCD_CUT else 1
        targets = [live[(first + i) % len(live)] for i in range(min(count, len(live)))]
        for number in targets:
            name = self.nodes[number].name
            if fault.kind == ETCD_CUT:
                self.network.cut_from_host(name)
            else:
                self.network.cut(name)
            self._heals.append((time.monotonic() + fault.seconds, number, index, fault.kind))
        detail: dict[str, Any] = {"seconds": fault.seconds}
        if fault.join:
            room = len(self.live) + len(self._paused) < self.scenario.max_nodes
            detail["new"] = self._start_new() if room else None
        self._act(index, fault.kind, [self.nodes[n].name for n in targets], **detail)

    def _heal_due(self, now: float, every: bool = False) -> None:
        for heal in [h for h in self._heals if every or h[0] <= now]:
            self._heals.remove(heal)
            due, number, index, kind = heal
            name = self.nodes[number].name
            # An overlapping cut of the same node, of the same kind, lasts to its end.
            still = any(h[1] == number and h[3] == kind for h in self._heals)
            if self.network is not None and not still:
                (self.network.heal_host if kind == ETCD_CUT else self.network.heal)(name)
            self._act(index, "healed", [name], early=now < due)

    def _stopped(self, number: int) -> None:
        """Node ``number`` leaves the job: not restarted in place, whatever its code."""
        self.live.discard(number)
        self._follow_ups = [
            f for f in self._follow_ups if not (f.action == "restart" and f.node == number)
        ]

    def _start_new(self) -> str:
        number = max(self.nodes, default=-1) + 1
        self._start_node(number)
        return self.nodes[number].name

    # -- triggered faults -------------------------------------------------------------------
    def _arm(self, index: int, fault: ChaosFault) -> None:
        until = time.monotonic() + fault.seconds
        self._armed.append(Armed(index, fault, time.time(), until))
        # The window the store is slowed for: the checks read it (a loss with no room to commit).
        self._act(index, fault.kind, [], armed=True, seconds=fault.seconds, delay_s=fault.delay_s)

    def _observe(self, number: int, record: Record) -> None:
        super()._observe(number, record)
        if record.get("event") == STARTED:
            self._fire("sigterm-restore", number, record["ts"], round=record.get("rdzv_round"))
            for other, paused in self._paused.items():
                if other != number and paused.reformed is None and record["ts"] > paused.since:
                    paused.reformed = time.monotonic()
        if acknowledged_step(record) is not None:
            self._check_ack(record)

    def _fire_uploads(self) -> None:
        if self.store is None:
            return
        for number, entry in self.store.uploads():
            self._fire("sigterm-upload", number, entry["ts"], object=entry["name"])
            self._fire("thaw-upload", number, entry["ts"], object=entry["name"])

    def _fire(self, kind: str, number: int, ts: float, **detail: Any) -> None:
        for armed in [a for a in self._armed if a.fault.kind == kind and ts >= a.since]:
            if number not in self.live:
                continue
            self._armed.remove(armed)
            if kind == "thaw-upload":
                self._pause(number, armed.fault, armed.index)
            else:
                self._evict(number, armed.fault)
            self._act(armed.index, kind, [self.nodes[number].name], landed=True, **detail)
            return

    def _expire(self, now: float) -> None:
        for armed in [a for a in self._armed if a.until <= now]:
            self._armed.remove(armed)
            self._act(armed.index, armed.fault.kind, [], landed=False, why="no such moment")

    # -- records ----------------------------------------------------------------------------
    def _check_ack(self, record: Record) -> None:
        """An acknowledged durable step: the store must hold it (or newer) verified, now."""
        if self.checkpoints is None:
            return
        scratch = self.checkpoints.parent / ".verify"
        newest = ShardedCheckpoints(FileStore(self.checkpoints), scratch).newest_verified()
        step = int(record["step"])
        found = newest.step if newest else None
        self.ack_checks.append(
            {"ts": record["ts"], "node": record["node"], "acked": step, "verified": found}
        )

    def _act(self, index: int, kind: str, nodes: list[str], **detail: Any) -> None:
        action = {"ts": round(time.time(), 3), "index": index, "kind": kind, "nodes": nodes}
        action |= detail
        self.actions.append(action)
        self.lab_log.write("chaos_fault", **{k: v for k, v in action.items() if k != "ts"})

    # -- the end ----------------------------------------------------------------------------
    def _finish(self) -> RunOutcome:
        """An evicted node still saving gets its grace, a frozen one is deleted at its time:
        the end of training does not cut their endings short; a node still paused never came
        back in time: it is deleted; a partition still on heals."""
        self._heal_due(time.monotonic(), every=True)
        for number, paused in list(self._paused.items()):
            del self._paused[number]
            self.nodes[number].kill()
            self._act(paused.index, "thawed", [], landed=False, why="training finished first")
        for follow_up in [f for f in self._follow_ups if f.action == "kill"]:
            node = self.nodes[follow_up.node]
            if wait_for_exit(node, max(follow_up.due - time.monotonic(), 0.0)) is None:
                node.kill()
        return super()._finish()
