"""How a run keeps its state in DCP checkpoints: each rank its own shards (``--parallelism=
fsdp2``), or its share of a replicated DDP state.

A checkpoint holds the model, the optimizer, the step, the scheduler, the RNG streams, fp16's
scaler, the run's identity and settings, through ``torch.distributed.checkpoint`` on the
durable store (training/checkpoints/sharded/). DDP uses the periodic and final saves below,
each rank writing its share of the replica (``replicated_share``); its emergency save and its
restore are a node's whole replica (``EmergencySave``, ``agree_on_resume``). A sharded run:

- **periodic saves**: every rank writes its shards at the same steps, in the background, one
  save in flight; at a due step the ranks agree (one small all-reduce) that none is still
  writing the previous one, so no rank is ever left alone in a save's collective;
- **an emergency save** (SIGTERM, a lost peer, the group re-forming): every rank saves its part
  alone (no collective: a peer may be gone) to the durable store, under the eviction's
  deadline when it is stopping, and keeps its file on the node's disk (a hard link);
- **the restore**: the coordinator commits the newest step that every rank of a world saved
  its part of, then every rank loads the newest checkpoint that verifies, resharded to this
  world, reading the files its node kept from its disk and only the others from the store.
  A node killed without notice leaves a part missing: the newest whole checkpoint serves,
  and the steps since are trained again (the same steps: docs/training.md);
- **finish**: one collective save of the final step, unless it is durable already.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from training.checkpoints.checkpoint import CheckpointError, Entry
from training.checkpoints.deadline import Deadline, persisting, why_not
from training.checkpoints.node_local import NONE
from training.checkpoints.resume import Resume
from training.checkpoints.serialization import snapshot
from training.checkpoints.sharded.parts import complete, drop_kept, part_set_id, save_part
from training.checkpoints.sharded.repository import (
    DoesNotFitState,
    ShardedCheckpoints,
    coordinator_decides,
)
from training.checkpoints.sharded.state import (
    ModelState,
    TrainerState,
    pack,
    replicated_share,
    resolve,
    unpack,
)
from training.checkpoints.storage import FileStore
from training.elastic.faults import sigterm_from_outside
from training.loop.saves.emergency import Outcome
from training.loop.step_guard import state_reads

logger = logging.getLogger("training")


class _Scaler(Stateful):
    """fp16's gradient scaler as a task's extra (``Precision`` owns it)."""

    def __init__(self, precision: Any) -> None:
        self.precision = precision

    def state_dict(self) -> dict[str, Any]:
        return self.precision.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.precision.load_state_dict(state_dict)


class ShardedState:
    """The state path of ``trainer``: its DCP checkpoints, and a sharded model's restore."""

    def __init__(self, trainer: Any, scratch: Path) -> None:
        """``trainer``: the ``StatefulTrainer`` (training/loop/trainer_state.py) that owns this
        (typed loosely: that module imports this one)."""
        self.t = trainer
        cfg = trainer.cfg.checkpoint
        # The parts this node's ranks save stay on its disk for the next round's load.
        local = trainer.local
        kept = FileStore(local.root / ".parts", fsync=False) if local is not None else None
        self.checkpoints = ShardedCheckpoints(
            trainer.store, scratch, cfg.checkpoint_keep, kept=kept
        )
        self.round_nonce = uuid.uuid4().hex
        """Names this round's parts; the coordinator's, agreed on at the restore."""
        self._emergency: Outcome | None = None
        self._emergency_lock = threading.Lock()
        self._boundary: tuple[int, dict[str, Any]] | None = None

    # -- what a checkpoint holds ---------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], TrainerState]:
        """What DCP saves and loads, and the trainer's part of it (its step after a load)."""
        t = self.t
        step = t.state.step
        extras = {
            **t.extras,
            **({"scaler": _Scaler(t.precision)} if t.precision.state_dict() else {}),
        }
        progress = TrainerState(
            step, t.sampler.consumed_samples(step), t.scheduler, extras, t.device
        )
        state = {
            "model": ModelState(t.model, t.optimizer),
            "trainer": progress,
            "run": pack(dict(t.identity)),
            "settings": pack(t.settings),
        }
        return state, progress

    def resolved(self) -> dict[str, Any]:
        """The state as plain values, its tensors the live ones (no copy): what DCP writes."""
        return resolve(self.state()[0])

    def mark_boundary(self) -> None:
        """The main thread, at a step boundary (the state restored, or a step applied, under
        the state lock): the state an emergency save reads, resolved here. Its tensors are the
        live ones, which only a step this rank voted for changes (the save waits for that:
        ``StepGate``); its other values (the step, the RNG streams, the scheduler) are this
        boundary's. FSDP2's ``state_dict()`` is never called from another thread: mid-forward
        its pre-hook reshards and frees the parameters the forward is using."""
        self._boundary = (self.t.state.step, self.resolved())

    def boundary(self) -> tuple[int, dict[str, Any]]:
        """(step, state) as the last ``mark_boundary`` took them; before any (a save of the
        state as built, not restored: the caller's thread is the main one), taken now."""
        if self._boundary is None:
            self.mark_boundary()
        assert self._boundary is not None
        return self._boundary

    def snapshot(self) -> dict[str, Any]:
        """A CPU copy of every rank's part (its shards stay DTensors: DCP places them). A
        replicated (DDP) state is copied only in this rank's share of it: a save of every
        rank's share holds the whole state once, and no rank copies all of it."""
        resolved = self.resolved()
        if self.t.cfg.run.parallelism == "fsdp2":
            return snapshot(resolved)
        flat, _ = flatten_state_dict(resolved)
        return snapshot(replicated_share(flat, self.t.env.rank, self.t.env.world_size))

    def apply(self, resolved: dict[str, Any]) -> None:
        """Load a state given as plain values (``resolved``'s form: a DDP restore's, sent by its
        holder) into the model, the optimizer and the trainer, once the identity matches."""
        t = self.t
        saved = {"run": unpack(resolved["run"]), "settings": unpack(resolved["settings"])}
        t._check_identity(saved)
        state, trainer_state = self.state()
        for key, part in state.items():
            if isinstance(part, Stateful):
                part.load_state_dict(resolved[key])
        t.state.step = trainer_state.step
        t._apply_changed_settings(saved)

    def refuse(self, step: int, error: CheckpointError) -> NoReturn:
        """A checkpoint that verifies but does not fit this state (``DoesNotFitState``): the
        settings that differ when its identity names them (ConfigError), else ``error``."""
        entry = next((e for e in self.checkpoints.entries() if e.step == step), None)
        try:
            saved = self.checkpoints.read_entry(entry, "run", values=True) if entry else None
        except (OSError, CheckpointError, CheckpointException) as exc:
            logger.warning("cannot read the identity of the checkpoint of step %d: %s", step, exc)
            saved = None
        if saved is not None:
            self.t._check_identity({"run": unpack(saved["run"])})
        raise error

    def untrained(self) -> bool:
        """Whether no step was taken yet: the state is then the seed's, which a fresh start
        rebuilds, so there is nothing to save. Not whether the optimizer holds state: fp16's
        scaler skips its first steps (their gradients overflow), and those steps, the scaler's
        backoff and the data consumed are state; a save of them holds the optimizer's
        hyperparameters in place of its state (``ModelState``)."""
        return self.t.state.step == 0

    # -- restore -------------------------------------------------------------------------------
    def restore(self) -> Resume:
        t, group = self.t, self.t.checkpoint_group
        started = time.monotonic()
        progress = t.local.progress() if t.local is not None else NONE
        known = torch.tensor([progress], dtype=torch.int64)
        dist.all_reduce(known, op=dist.ReduceOp.MAX, group=group)
        # The newest whole set of parts committed, by one process.
        self.round_nonce, from_parts = coordinator_decides(self._complete_parts, group)
        state, trainer_state = self.state()
        fresh = not t.optimizer.state
        try:
            entry = self.checkpoints.load(state, group=group)
        except DoesNotFitState as exc:
            self.refuse(exc.entry.step, exc)
        if entry is None and t.cfg.checkpoint.init_from:  # collectives: outside the lock
            t._initialize_from(t.cfg.checkpoint.init_from)
        with t._state_lock:
            if entry is not None:
                self._apply(state, trainer_state)
            elif fresh:  # a checkpoint that failed to load asked for a state, made up
                t.optimizer.state.clear()
            self.mark_boundary()
            t.restored = True
        step = entry.step if entry is not None else 0
        if entry is not None:
            t.committed.advance(step)
        source = "fresh" if entry is None else "parts" if from_parts else "durable"
        lost = max(int(known) - step, 0) if int(known) != NONE else None
        return Resume(None, step, source, 0, lost, time.monotonic() - started)

    def _complete_parts(self) -> tuple[str, bool]:
        """(this round's nonce, whether a whole set of parts newer than the head was
        committed): the coordinator's, before every rank loads."""
        head = self.checkpoints.repository.head()
        completed = complete(self.checkpoints, head.step if head is not None else NONE)
        return self.round_nonce, completed is not None

    def _apply(self, state: dict[str, Any], trainer_state: TrainerState) -> None:
        """After a load: the step, the identity's check and any changed settings."""
        t = self.t
        t.state.step = trainer_state.step
        saved = {"run": unpack(state["run"]), "settings": unpack(state["settings"])}
        t._check_identity(saved)
        t._apply_changed_settings(saved)

    # -- periodic saves ------------------------------------------------------------------------
    def maybe_save(self, last: list[float]) -> None:
        """Every rank, at the same steps: snapshot in the loop (the stall), write behind it."""
        t = self.t
        now = time.monotonic()
        due = t.policy.should_save(t.state.step, int(last[0]), last[1], now)
        if not due and not t.policy.every_seconds:
            return  # a step-based save comes due at the same step on every rank
        votes = t.guard.all_reduce(torch.tensor([float(due), float(t.saver.busy)]))
        if votes[0] == 0 or votes[1] > 0:
            return  # not due anywhere, or some rank still writes the previous one
        started = time.perf_counter()
        staged = self.snapshot()
        t._stalls[t.state.step] = time.perf_counter() - started
        if t.saver.submit(t.state.step, staged):
            last[0], last[1] = t.state.step, now

    def write(self, step: int, staged: dict[str, Any]) -> Entry | None:
        """The saver's thread: every rank's shards, committed by the coordinator."""
        entry = self.checkpoints.save(staged, step, group=self.t.checkpoint_group)
        self.t.committed.advance(step)  # the save returned on every rank only once committed
        return entry

    # -- emergency -----------------------------------------------------------------------------
    def emergency_save(self, reason: str, stopping: Callable[[], bool]) -> Outcome:
        """This rank's part of the last completed step, durably, once per step. The loop (a
        lost peer) and the SIGTERM thread may both get here: the second waits, within the
        deadline, and returns what the first did; two writers of one part would leave a file
        whose bytes are not those its record hashed."""
        t = self.t
        going = stopping()
        deadline = t.emergency.note_stop() if going else None
        if not self._emergency_lock.acquire(timeout=deadline.remaining() if deadline else -1):
            logger.error("part of step %d: another save held on past the deadline", t.state.step)
            return Outcome(t.state.step, going, False, "deadline")
        try:
            return self._emergency_save(reason, going, deadline)
        finally:
            self._emergency_lock.release()

    def _emergency_save(self, reason: str, going: bool, deadline: Deadline | None) -> Outcome:
        t = self.t
        step, state = self.boundary()
        if self._emergency is not None and self._emergency.step == step:
            return self._emergency
        if self.untrained():
            return Outcome(step, False, True)  # the seed rebuilds it: nothing to save
        # Torch closing this node's workers (a re-form) needs the part, but the node stays.
        required = going and (t.env.last_round or sigterm_from_outside())
        started = time.monotonic()
        durable, gave_up = t.committed.step >= step, None
        if not durable:
            durable, gave_up = self._save_part(step, state, deadline)
        self._emergency = Outcome(step, required, durable, gave_up)
        if t.env.local_rank == 0:  # one line per node, as the DDP path's
            t.events.event(
                "emergency_save",
                step=step,
                reason=reason,
                seconds=round(time.monotonic() - started, 4),
                durable=durable,
                local=False,
                deadline_s=t.emergency.deadline_s if deadline else None,
                gave_up=gave_up,
            )
        return self._emergency

    def _save_part(
        self, step: int, state: dict[str, Any], deadline: Deadline | None
    ) -> tuple[bool, str | None]:
        t = self.t
        part_id = part_set_id(self.checkpoints.repository.prefix, step, self.round_nonce)

        env = t.env

        def save() -> None:
            with state_reads():  # after the last optimizer step's kernels, as cpu_state
                save_part(
                    self.checkpoints, state, part_id, step, env.rank, env.world_size, deadline
                )

        what = f"part {t.env.rank} of step {step}"
        try:
            persisting(deadline, save, what)
        except (OSError, CheckpointError) as exc:  # DeadlineExceeded is a TimeoutError
            logger.error("%s could not be saved: %s", what, exc)
            return False, why_not(exc)
        return True, None

    # -- the end -------------------------------------------------------------------------------
    def finish(self) -> None:
        """The final step, saved by every rank unless it is durable already."""
        t, group = self.t, self.t.checkpoint_group
        t.saver.wait()
        # The store, not this process's memory, says what is durable (by the objects' sizes:
        # no download): another writer or a damaged object may have changed it.
        head = coordinator_decides(self.checkpoints.repository.newest_intact, group)
        if (head is None or head.step < t.state.step) and not self.untrained():
            state, _ = self.state()
            self.checkpoints.save(state, t.state.step, group=group)
        t.committed.advance(t.state.step)
        drop_kept(self.checkpoints, before=t.state.step + 1)  # the run is over: none is read
