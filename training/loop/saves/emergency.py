"""The emergency save: the last completed step, kept before a worker exits.

Node-local first (the next round on this node reads it, with no storage round trip), then,
when the node is going away, a durable commit: rank 0 whenever its agent was stopped (a
SIGTERM torch sends to close the node's workers, when a sibling exited or the group re-forms,
is not one: ``sigterm_from_outside``), and any node's local rank 0 in its agent's last round
(its new pod's disk is empty). On SIGTERM both
run under one hard deadline from the signal (``--stop-deadline-s``, 25 s of the 30 s notice by
default): past it the worker gives up the durable commit, keeps the node-local copy, logs
so, and exits ``RETRY_ME`` (the store, a cause outside the node a new pod may not meet).

Either part happens once per step, whoever asks: a peer's loss may start a save that stays on
the node, and this node's own SIGTERM, arriving during that save or after it, still makes it
durable. The state is serialized once, straight into a file on the node
(``training/checkpoints/serialization.py``); the durable commit maps that file and writes it,
item by item, as a ``torch.distributed.checkpoint`` checkpoint of this process alone
(``ShardedCheckpoints.save_alone``): every rank of a DDP run holds the same state. The
eviction's commit skips pruning and, like every commit, never reads its upload back
(``training/checkpoints/checkpoint.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from training.checkpoints.checkpoint import CheckpointError, Payload, StaleCheckpoint
from training.checkpoints.deadline import (
    Deadline,
    DeadlineExceeded,
    persisting,
    retrying,
    why_not,
    within,
)
from training.checkpoints.node_local import NONE, NodeLocalState, node_local_key
from training.checkpoints.node_prune import SCRATCH
from training.checkpoints.serialization import load_mapped
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.writer import SaveOptions
from training.elastic.exit_codes import RETRY_ME
from training.elastic.faults import sigterm_from_outside
from training.loop.config import ConfigError, TrainConfig
from training.loop.dist import DistEnv
from training.loop.inputs import open_durable
from training.loop.metrics import EventLog
from training.loop.saves.periodic import BackgroundSaver

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class DurableProgress:
    """The newest step known to be committed durably (restored, or saved by this process)."""

    step: int = NONE

    def advance(self, step: int) -> None:
        self.step = max(self.step, step)


@dataclass(frozen=True)
class Outcome:
    """What an emergency save achieved."""

    step: int
    durable_required: bool
    durable: bool
    gave_up: str | None = None
    """Why a required durable commit was not made."""

    @property
    def complete(self) -> bool:
        return self.durable or not self.durable_required


class EmergencySave:
    """Saves the last completed step for a worker that is about to exit (local rank 0 only)."""

    def __init__(
        self,
        env: DistEnv,
        local: NodeLocalState | None,
        durable: ShardedCheckpoints,
        saver: BackgroundSaver,
        committed: DurableProgress,
        events: EventLog,
        deadline_s: float,
    ) -> None:
        self.env, self.local, self.durable = env, local, durable
        self.saver, self.committed, self.events = saver, committed, events
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._deadline_lock = threading.Lock()
        self._deadline: Deadline | None = None
        self._local: tuple[int, Payload] | None = None
        """The step saved on this node and its bytes, once saved."""
        self._given_up = NONE
        """A step whose required durable commit already gave up: not tried twice."""

    def note_stop(self, at: float | None = None) -> Deadline:
        """A stop (SIGTERM) came at ``at`` (``time.monotonic``; None: now): the save's deadline
        runs from the first such call."""
        with self._deadline_lock:  # never held across I/O
            if self._deadline is None:
                self._deadline = Deadline(
                    (time.monotonic() if at is None else at) + self.deadline_s
                )
        return self._deadline

    def save(
        self,
        step: int,
        state: Callable[[], dict[str, Any]],
        reason: str,
        stopping: Callable[[], bool],
    ) -> Outcome | None:
        """Save ``step`` (``state()`` gives its tree); None on a rank that does not save.

        ``stopping()`` says whether the node is going away; it is asked again after the
        node-local save, since a SIGTERM may come in the middle of it.
        """
        if self.env.local_rank != 0:
            return None  # one writer per node; rank 0 is always its node's local rank 0
        deadline = self._deadline if stopping() else None
        # The loop and the SIGTERM thread may both get here; the second waits, within the
        # deadline, and then only does what the first left undone.
        if not self._lock.acquire(timeout=deadline.remaining() if deadline else -1):
            logger.error("emergency save of step %d: another save held on past the deadline", step)
            return Outcome(step, True, False, "deadline")
        try:
            return self._save(step, state, reason, stopping)
        finally:
            self._lock.release()

    def _save(
        self,
        step: int,
        state: Callable[[], dict[str, Any]],
        reason: str,
        stopping: Callable[[], bool],
    ) -> Outcome:
        started = time.monotonic()
        timings: dict[str, float] = {}
        if self._local is None or self._local[0] != step:
            payload = self._bounded(self._deadline_if(stopping), self._save_locally, step, state)
            self._local = (step, payload) if payload is not None else None
            timings["local_s"] = time.monotonic() - started
        going = stopping()
        if going and not self.env.last_round and not sigterm_from_outside():
            going = False  # torch closing this node's workers: the node stays, and its save
        required = going and (self.env.rank == 0 or self.env.last_round)
        durable, gave_up = self.committed.step >= step, None
        if required and not durable and self._given_up != step:
            durable, gave_up = self._commit_durably(step, state, self._deadline_if(stopping))
            timings["durable_s"] = time.monotonic() - started
        outcome = Outcome(step, required, durable, gave_up)
        self.events.event(
            "emergency_save",
            step=step,
            reason=reason,
            seconds=round(time.monotonic() - started, 4),
            durable=durable,
            local=self._local is not None and self._local[0] == step,
            deadline_s=self.deadline_s if self._deadline_if(stopping) else None,
            gave_up=gave_up,
            **{k: round(v, 4) for k, v in timings.items()},
        )
        return outcome

    def _deadline_if(self, stopping: Callable[[], bool]) -> Deadline | None:
        return self._deadline if stopping() else None

    def _bounded(self, deadline: Deadline | None, work: Callable[..., T], *args: Any) -> T | None:
        """``work(*args)``, given up (None) when the deadline passes first."""
        try:
            if deadline is None:
                return work(*args)
            return within(deadline, lambda: work(*args), work.__name__)
        except DeadlineExceeded:
            logger.error("%s of step %s gave up at the deadline", work.__name__, args[0])
            return None

    def _save_locally(self, step: int, state: Callable[[], dict[str, Any]]) -> Payload | None:
        if self.local is None:
            return None
        try:
            return self.local.save_state(step, state())
        except (OSError, CheckpointError) as exc:  # the durable commit may still succeed
            logger.error("node-local emergency save of step %d failed: %s", step, exc)
            return None

    def _commit_durably(
        self, step: int, state: Callable[[], dict[str, Any]], deadline: Deadline | None
    ) -> tuple[bool, str | None]:
        """(durable, why not): the node's save made durable, within ``deadline``."""
        if self.saver.in_flight == step:  # a periodic save of this very step: let it finish
            self.saver.wait(deadline.remaining() if deadline else None)
            if self.committed.step >= step:
                return True, None
        payload = self._local[1] if self._local and self._local[0] == step else None

        def commit() -> None:
            # The node's save, mapped: read once, as it uploads. With none (its disk failed,
            # or there is no node-local directory), the state in memory.
            saved = load_mapped(payload.source) if payload is not None else state()
            self.durable.save_alone(saved, step, SaveOptions(deadline=deadline, prune=False))

        try:
            persisting(deadline, commit, "durable emergency commit")
        except StaleCheckpoint as exc:  # a newer step is durable already: nothing is lost
            logger.info("durable emergency commit not needed: %s", exc)
            return True, None
        except (OSError, CheckpointError) as exc:  # DeadlineExceeded is a TimeoutError
            self._given_up = step
            where = self.local.root if self._local else "nowhere: the node-local save failed too"
            logger.error(
                "durable emergency commit of step %d gave up (%s); the node-local copy stays in "
                "%s; the worker exits %d",
                step,
                exc,
                where,
                RETRY_ME,
            )
            return False, why_not(exc)
        self.committed.advance(step)
        return True, None

    def commit_leftover(self) -> Outcome | None:
        """SIGTERM before this round restored anything: make this node's newest save durable
        when it is newer than the durable head, so an eviction of every node loses nothing."""
        if self.env.local_rank != 0 or self.local is None:
            return None
        if not self.env.last_round and not sigterm_from_outside():
            return None  # torch closing this node's workers: the node, and its save, stay
        deadline = self.note_stop()
        what = "durable commit of the node-local save"
        try:
            found = persisting(deadline, self._leftover, what)
        except (OSError, CheckpointError) as exc:
            logger.error("could not make the node-local save durable before exiting: %s", exc)
            return Outcome(NONE, True, False, str(exc)[:200])
        return found

    def _leftover(self) -> Outcome | None:
        assert self.local is not None
        step = commit_if_newer(self.local, self.durable, self._deadline)
        if step is None:
            return None
        self.committed.advance(step)
        self.events.event("emergency_save", step=step, reason="leftover", durable=True)
        return Outcome(step, True, True)


def commit_if_newer(
    local: NodeLocalState, durable: ShardedCheckpoints, deadline: Deadline | None
) -> int | None:
    """Commit this node's newest save durably when it is newer than the durable head; the
    step committed, or None. Its bytes are verified, then it is mapped from the node's file
    and written item by item as a DCP checkpoint; the head is read before anything is
    uploaded (on a slow store every round trip counts against the eviction's deadline)."""
    newest = local.newest()
    if newest is None:
        return None
    step, payload = newest
    options = SaveOptions(deadline=deadline, prune=False, newer_only=True)
    try:
        durable.save_alone(load_mapped(payload.source), step, options)
    except StaleCheckpoint:
        return None
    return step


def commit_node_save(cfg: TrainConfig, run_id: str, stopped_at: float | None) -> int | None:
    """The agent's last act after its SIGTERM, when no worker of its is left to do it: make
    the node's newest save durable if it is newer than the durable head; the step, or None.

    A worker that lost a peer keeps its save on the node and exits 75; a SIGTERM that reaches
    the agent before the next worker starts (or a worker not rank 0, which commits nothing
    durably) would otherwise lose it with the pod. Under the eviction's deadline from the
    signal. The bytes are checked against their SHA-256 and copied; never unpickled.
    """
    deadline = Deadline(
        (time.monotonic() if stopped_at is None else stopped_at) + cfg.checkpoint.stop_deadline_s
    )

    def commit() -> int | None:
        repository, lineage = open_durable(cfg, retry_s=deadline.remaining(), read_head=False)
        key = node_local_key(run_id, cfg.checkpoint.checkpoint_uri, lineage)
        local = NodeLocalState(cfg.checkpoint.local_dir, key)
        scratch = Path(cfg.checkpoint.local_dir) / SCRATCH
        durable = ShardedCheckpoints(repository.store, scratch, cfg.checkpoint.checkpoint_keep)
        what = "the agent's durable commit of the node's save"
        return retrying(deadline, lambda: commit_if_newer(local, durable, deadline), what)

    try:
        step = within(deadline, commit, "the agent's durable commit of the node's save")
    except (OSError, CheckpointError, ConfigError) as exc:  # DeadlineExceeded is an OSError
        logger.error("could not make the node's save durable before exiting: %s", exc)
        return None
    if step is not None:
        logger.info("the node's save of step %d is durable now", step)
        EventLog(DistEnv(run_id=run_id), agent=True).event(
            "emergency_save", step=step, reason="agent", durable=True
        )
    return step
