"""The workers' permit to apply a step: a deadline their agent renews while it knows that its
round is still the run's.

A paused VM that comes back (a host's freeze; SIGSTOP and SIGCONT in the lab) resumes its
workers where they were. In a group of several nodes their next collective waits for peers
that went on without them, and fails. Alone in its round, nothing waits: the workers would
train on in a round the run has left, beside the group that replaced it, until their agent's
watch tells it (the chaos campaign's seed 104: a step 0.1 s after the thaw).

So a worker applies a step only while the permit holds (``hold``, before the optimizer step:
a read of 16 bytes of shared memory). The agent renews it on every poll of its monitor loop
(0.1 s) for ``GAP_S`` ahead (``Keeper.tick``). A poll that finds it run out (no poll for
``GAP_S``) means the agent itself was stopped or starved: it renews only once a read of etcd
(not its watched copy, which is as old as the pause) shows its round is still the run's, and
re-forms when it is not. Meanwhile the workers wait, but only those that were paused too
since the last grant (``Pauses``): an agent stopped alone, its workers running (a wedged
agent), stops no one; its key decides, as before.

The fence: a node cut off from etcd but not from its peers (a member cut off from the quorum,
a subnet cut) cannot renew its lease, and once the lease expires the others form a round
without it. So the permit never reaches past ``fence`` (training/elastic/membership.py: the
granted TTL past the last keep-alive etcd answered, less one keep-alive's timeout and etcd's
check for expired leases). A grant that the fence cuts short is written as *fenced*: the
workers wait at it whatever their own pauses (a lapse that is no wedged agent's), and once the
fence passes, ``tick`` says the group must re-form: the agent stops its workers (they save
node-locally, as on any re-form) and joins the next round once etcd answers.

Why ``GAP_S`` is short enough: the others leave this node out only once its key expired
(``keep_alive_interval_s`` x ``keep_alive_max_attempt``, 5 s by default, after its last
keep-alive, at most ``keep_alive_interval_s`` before the pause) and a new round then starts its
workers; a permit renewed before the pause runs out ``GAP_S`` (0.5 s) after it. What remains:
a read that confirms the round a moment before another node completes the next one; the
agent's watch then stops the workers within a poll, before the new round's workers have
restored their state.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

PERMIT_FILE_ENV = "TRAIN_PERMIT_FILE"
"""The permit's file, which the warm launcher names and its rendezvous handler creates; a
worker without one (plain torchrun, a test's trainer) is never held."""
GAP_S = 0.5
"""How far ahead a poll renews the permit."""
POLL_S = 0.01
"""How often a held worker looks again."""
TICK_S = 0.05
"""How often a worker's own watch looks at the clock (``Pauses``)."""
_LAYOUT = struct.Struct("<dd")
"""The deadline twice (``time.monotonic``, one clock for every process of the host): a reader
that sees two different values read it mid-write and reads again. A fenced deadline is written
as (deadline, -deadline)."""


class Permit:
    """The permit's file, mapped: the agent grants, its workers hold."""

    def __init__(self, path: Path, writable: bool = False) -> None:
        self.path = path
        mode = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        fd = os.open(path, mode, 0o600)
        try:
            if writable and os.fstat(fd).st_size < _LAYOUT.size:
                os.ftruncate(fd, _LAYOUT.size)  # zeros: lapsed until the first grant
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._map = mmap.mmap(fd, _LAYOUT.size, access=access)
        finally:
            os.close(fd)

    def grant(self, until: float, fenced: bool = False) -> None:
        """Workers may step until ``until``; ``fenced``: and not a moment past it, whatever
        their own pauses (the agent's lease may expire then)."""
        self._map[: _LAYOUT.size] = _LAYOUT.pack(until, -until if fenced else until)

    def read(self) -> tuple[float, bool]:
        """The deadline, and whether it is fenced."""
        while True:
            first, second = _LAYOUT.unpack(self._map[: _LAYOUT.size])
            if first == second or first == -second:
                return first, first == -second and first != 0

    def until(self) -> float:
        return self.read()[0]

    def hold(
        self,
        stopped: Callable[[], bool],
        waiting: Callable[[float], None],
        pauses: Pauses | None = None,
    ) -> float | None:
        """The wall time (epoch seconds) of the check that found the permit holding, or that
        found it run out while this process ran on (``pauses``: only its agent was away, a
        wedged agent stops no one; never past a fence, which holds every worker); None when
        ``stopped()`` first. ``waiting`` is told once, with how long ago the permit ran out,
        when this call has to wait.

        The wall time is read just before the check: a pause between the two leaves the
        permit run out at the check (a pause longer than ``GAP_S``), so the time returned is
        never older than a pause the check missed."""
        told = False
        while True:
            wall, now, (until, fenced) = time.time(), time.monotonic(), self.read()
            if now < until:
                return wall
            if pauses is not None and not fenced and not pauses.since(until - GAP_S):
                return wall
            if stopped():
                return None
            if not told:
                waiting(now - until)
                told = True
            time.sleep(POLL_S)

    @classmethod
    def of_agent(cls) -> Permit | None:
        """The permit this agent keeps for its workers (made, run out), or None when its
        launcher named none."""
        name = os.environ.get(PERMIT_FILE_ENV)
        return cls(Path(name), writable=True) if name else None

    @classmethod
    def of_worker(cls) -> Permit | None:
        """The permit this worker's agent keeps, or None when it keeps none."""
        name = os.environ.get(PERMIT_FILE_ENV)
        if not name or not Path(name).exists():
            return None
        return cls(Path(name))


_PROCESS: list[Pauses] = []
_PROCESS_LOCK = threading.Lock()


def watch_pauses() -> None:
    """Start this process's watch for pauses when its agent keeps a permit (a worker of the
    warm launcher); after ``StopRequest``, which must come before any thread."""
    if os.environ.get(PERMIT_FILE_ENV):
        Pauses.of_process()


class Pauses:
    """This process's own pauses, seen by a thread that looks at the clock every ``tick_s``:
    a look later than ``gap_s`` means the process was stopped (its VM, or its tree, paused)
    or starved that long."""

    def __init__(
        self,
        gap_s: float = GAP_S,
        tick_s: float = TICK_S,
        clock: Callable[[], float] = time.monotonic,
        watch: bool = True,
    ) -> None:
        self.gap_s, self.clock = gap_s, clock
        self.last = clock()
        self.resumed = float("-inf")
        """When the latest pause ended (as this process's watch saw it)."""
        if watch:
            threading.Thread(target=self._watch, args=(tick_s,), name="pauses", daemon=True).start()

    def _watch(self, tick_s: float) -> None:
        while True:
            time.sleep(tick_s)
            self.look()

    @classmethod
    def of_process(cls) -> Pauses:
        """This process's one watch, started by the first call. A worker starts it as it
        starts (``training.train.run``), not when it begins to train: a pause in its restore
        counts too (chaos seed 104 again: a worker paused inside the commit after its resume
        trained two steps in a round the run had left)."""
        with _PROCESS_LOCK:
            if not _PROCESS:
                _PROCESS.append(cls())
            return _PROCESS[0]

    def look(self) -> None:
        now = self.clock()
        if now - self.last > self.gap_s:
            self.resumed = now
        self.last = now

    def since(self, moment: float) -> bool:
        """Whether this process paused after ``moment``, or is in a pause its watch has not
        looked past yet (the first thread to run after a SIGCONT may be any)."""
        return self.resumed > moment or self.clock() - self.last > self.gap_s


class Keeper:
    """The agent's side: renews the permit on every poll, never past ``fence()``; once it has
    run out (no poll for ``gap_s``), only after ``still_current()`` says the round is still the
    run's (None: it could not tell, and the next poll asks again)."""

    def __init__(
        self,
        permit: Permit | None,
        still_current: Callable[[], bool | None],
        clock: Callable[[], float] = time.monotonic,
        gap_s: float = GAP_S,
        fence: Callable[[], float] = lambda: float("inf"),
    ) -> None:
        self.permit, self.still_current, self.clock, self.gap_s = (
            permit,
            still_current,
            clock,
            gap_s,
        )
        self.fence = fence
        self._fenced = False

    def _grant(self, now: float) -> None:
        if self.permit is not None:
            limit = self.fence()
            self.permit.grant(min(now + self.gap_s, limit), fenced=limit < now + self.gap_s)

    def started(self) -> None:
        """A round completed: its workers may step."""
        self._fenced = False
        self._grant(self.clock())

    def tick(self) -> bool:
        """One poll of the monitor loop; False when etcd says the run left this round, or when
        the fence passed (this node's lease may have expired: the others may go on without
        it)."""
        now = self.clock()
        if now >= (limit := self.fence()):
            if not self._fenced:
                logger.warning(
                    "no keep-alive answered %.1f s past the lease's TTL less the margin: "
                    "fenced, the workers stop before their next step; re-forming once etcd "
                    "answers",
                    now - limit,
                )
                self._fenced = True
            return False
        if self.permit is None:
            return True
        if now >= (until := self.permit.until()):
            current = self.still_current()
            if current is False:
                logger.warning("the run went on without this node while it was away: re-forming")
            if not current:
                return current is None
            logger.info(
                "the agent was away (its permit ran out %.1f s ago); etcd says its round goes on",
                now - until,
            )
        self._grant(now)
        return True
