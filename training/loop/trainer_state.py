"""A trainer's state and how it is kept: what a checkpoint holds, restore, saves and the stop.

The state is the task's model (unwrapped from DDP), its optimiser and LR scheduler, the step and
epoch (the data position derives from the step), the run's identity and torch's RNG streams (the
task's own randomness is keyed by step and sample: training/api/keyed_random.py). Every rank saves
its share in the background while the loop trains (training/loop/saves/periodic.py); a stop or a
lost peer saves
the last completed step (training/loop/saves/emergency.py), on the SIGTERM's own thread when the
loop may be stuck in a collective. A state lock keeps every save to the state of a completed step;
the step's vote puts a stop's save on the same side of a step on every rank (training/loop/
step_guard.py, ``StepGate``); and the save reads the state as the main thread resolved it at the
last step boundary (``ShardedState.mark_boundary``), never from its own thread mid-step.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.api import Data, TrainSpec
from training.api.spec import checked_extras
from training.checkpoints.checkpoint import Entry
from training.checkpoints.devices import use_device
from training.checkpoints.node_local import NodeLocalState
from training.checkpoints.node_prune import sweep_scratch
from training.checkpoints.resume import DurableSource, Resume, agree_on_resume
from training.checkpoints.sharded.state import rng_state, set_rng_state
from training.checkpoints.storage import ObjectStore
from training.data.loader import open_loader, sampler_for
from training.elastic.exit_codes import RETRY_ME, WORKER_RESTART
from training.elastic.faults import StopRequest
from training.loop import run_changes
from training.loop.config import ConfigError, TrainConfig
from training.loop.dist import DistEnv
from training.loop.inputs import STORAGE_KEY, run_identity
from training.loop.metrics import EventLog
from training.loop.parallel import build_parts
from training.loop.saves.emergency import DurableProgress, EmergencySave, Outcome
from training.loop.saves.periodic import BackgroundSaver, SavePolicy, report_failure
from training.loop.saves.sharded import ShardedState
from training.loop.step.precision import Precision
from training.loop.step_guard import StepGate, StepGuard, cpu_state

logger = logging.getLogger("training")

# Whatever runs the worker's exit: the SIGTERM thread holds it while it saves, so the main
# thread, done with the loop, cannot end the process under a durable commit in flight.
_EXIT_LOCK = threading.RLock()


@dataclass
class LoopPosition:
    """The loop's own position; the data position derives from the step alone."""

    step: int = 0


class StatefulTrainer:
    """A trainer's state and every way it is kept: what a checkpoint holds, the restore the
    ranks agree on, rank 0's periodic saves in the background, the emergency save and the
    SIGTERM's stop. ``Trainer`` (training/loop/trainer.py) adds the loop."""

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        data: Data,
        store: ObjectStore,
        local: NodeLocalState | None,
        events: EventLog,
        checkpoint_group: dist.ProcessGroup | None = None,
        guard: StepGuard | None = None,
        spec: TrainSpec | None = None,
    ) -> None:
        """``checkpoint_group`` carries the collectives that wait on storage (restore, finish);
        None uses the default group. ``guard`` checks every step before ``optimizer.step()``
        where the gradient all-reduce may complete without a lost peer (NCCL). ``spec`` is
        the task (None: the one ``cfg`` names)."""
        self.cfg, self.env, self.device, self.data = cfg, env, device, data
        self.dataset = data.train
        self.spec = spec or cfg.spec
        self.store, self.local, self.events = store, local, events
        """The durable store: its checkpoints are ``self.dcp.checkpoints``."""
        self.checkpoint_group = checkpoint_group
        self.guard = guard or StepGuard(None)
        self.identity = run_identity(cfg, self.dataset)
        torch.manual_seed(cfg.run.seed)  # same init on every rank, before any restore
        self.dtype: torch.dtype = getattr(torch, cfg.run.dtype)
        self.parts = build_parts(self.spec, cfg, data, device, self.dtype)  # --parallelism
        self.extras = checked_extras(self.spec.name, self.parts.extras)
        for extra in self.extras.values():  # the model is final: on its device, sharded
            extra.attach(self.parts.model)
        self.model = self.parts.model
        self.optimizer = self.parts.optimizer
        self.scheduler = self.parts.scheduler
        self.precision = Precision(cfg.run.precision, device)  # fp16's scaler is state
        self.settings = run_changes.settings(cfg, self.optimizer)  # as built, before any step
        self.sampler = sampler_for(self.dataset, cfg.optim.global_batch_size, cfg.run.seed)
        self.loader = open_loader(
            self.dataset,
            self.sampler,
            env.world_size,
            env.rank,
            cfg.data.loader_workers,
            cfg.data.prefetch_steps,
        )
        self.state = LoopPosition()
        self.policy = SavePolicy(
            cfg.checkpoint.checkpoint_every_steps, cfg.checkpoint.checkpoint_every_seconds
        )
        self.scratch = Path(cfg.checkpoint.local_dir) / ".scratch"
        """Local disk for a save's files before their upload and a load's after the download."""
        sweep_scratch(self.scratch)  # what a killed save or load left: up to a state each
        self.dcp = ShardedState(self, self.scratch)
        """The checkpoints (``torch.distributed.checkpoint``) and the periodic and final saves
        of either parallelism (training/loop/saves/sharded.py)."""
        self.sharded = self.dcp if cfg.run.parallelism == "fsdp2" else None
        """A sharded model's emergency saves and restore; None: DDP's, which a node's replica
        serves (``EmergencySave``, ``agree_on_resume``)."""
        self.saver = BackgroundSaver(self.dcp.write, self._on_saved, self._on_save_failed)
        self._stalls: dict[int, float] = {}
        self.committed = DurableProgress()
        self.emergency = EmergencySave(
            env,
            local,
            self.dcp.checkpoints,
            self.saver,
            self.committed,
            events,
            cfg.checkpoint.stop_deadline_s,
        )
        self.restored = False
        """Whether the state is this run's (restored or fresh): only then is it worth saving."""
        self._state_lock = threading.Lock()
        """Held while the state changes (restore, optimizer step, step count), never across a
        collective: whoever holds it sees the state of a completed step."""
        self.gate = StepGate(wait_for_vote=cfg.run.parallelism == "fsdp2")
        """Which side of a step's vote a stop's save is on (training/loop/step_guard.py): a
        sharded state's save waits for a vote in flight, a replicated one's does not."""

    # -- state -------------------------------------------------------------------------------
    def small_state(self) -> dict[str, Any]:
        """What a restore puts back besides the parameters and the optimizer's moments: the
        optimizer's hyperparameters, the scheduler, the RNG streams and the buffers (e.g.
        BatchNorm's statistics: small next to the parameters)."""
        return {
            "param_groups": [
                {k: v for k, v in group.items() if k != "params"}
                for group in self.optimizer.param_groups
            ],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": rng_state(self.device),
            "buffers": {name: b.detach().clone() for name, b in self.model.named_buffers()},
        }

    def load_small_state(self, state: dict[str, Any]) -> None:
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.device)
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, saved in state["buffers"].items():
                buffers[name].copy_(saved)

    def _check_identity(self, state: dict[str, Any]) -> None:
        # A state written before a task option existed holds no value for it: it was trained
        # at that option's default, and matches a run that keeps the default. One written
        # before the identity left out what may change holds those too: not compared.
        defaults = {f.name: f.default for f in fields(self.cfg.options)}
        theirs = {**defaults, **state["run"]}
        skipped = {STORAGE_KEY, *self.settings["values"]}
        theirs = {k: v for k, v in theirs.items() if k not in skipped}
        mine = {k: v for k, v in self.identity.items() if k not in skipped}
        if theirs != mine:
            differ = sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k))
            raise ConfigError(
                "the checkpoint was written with "
                + ", ".join(f"{k}={theirs.get(k)!r}" for k in differ)
                + "; this run has "
                + ", ".join(f"{k}={mine.get(k)!r}" for k in differ)
                + ". Use a new --checkpoint-uri (a new runId), or the checkpoint's settings "
                "and dataset"
            )

    def _apply_changed_settings(self, state: dict[str, Any]) -> None:
        """The learning rate and options changed since the state was saved: logged, and used
        from the next step (training/loop/run_changes.py)."""
        defaults = {f.name: f.default for f in fields(self.cfg.options)}
        saved = run_changes.saved_settings(state, self.settings, defaults)
        changed = run_changes.changed_values(saved, self.settings)
        run_changes.apply_changes(saved, self.settings, self.optimizer, self.scheduler)
        if changed and self.env.rank == 0:
            self.events.event("settings_changed", step=self.state.step, changed=changed)
            logger.info(
                "resumed with changed settings from step %d: %s",
                self.state.step,
                ", ".join(f"{k} {v['old']!r} -> {v['new']!r}" for k, v in changed.items()),
            )

    def _initialize_from(self, uri: str) -> None:
        """``--init-from``: another run's newest weights, this run's fresh optimizer, step 0;
        every rank together, each its own shards (a DDP replica: all of them)."""
        step = run_changes.load_initial_shards(uri, self.model, self.scratch, self.checkpoint_group)
        if self.env.rank == 0:
            self.events.event("initialized", uri=uri, from_step=step)
            logger.info("initialized the model from %s, step %d", uri, step)

    def restore(self) -> Resume:
        """The newest state any rank holds, loaded on every rank (``agree_on_resume``; a
        sharded model's: ``ShardedState.restore``)."""
        resume = self.sharded.restore() if self.sharded is not None else self._restore_whole()
        if self.env.rank == 0:
            self.events.event(
                "resumed",
                step=resume.step,
                source=resume.source,
                from_rank=resume.from_rank,
                lost_steps=resume.lost_steps,
                world_size=self.env.world_size,
                seconds=round(resume.seconds, 4),
            )
            logger.info(
                "resumed at step %d from %s (rank %d), %s steps lost, world size %d",
                resume.step,
                resume.source,
                resume.from_rank,
                resume.lost_steps,
                self.env.world_size,
            )
        return resume

    def _restore_whole(self) -> Resume:
        # A gloo checkpoint group carries CPU tensors, whatever the default backend.
        device = self.device if self.checkpoint_group is None else torch.device("cpu")
        durable = DurableSource(self.dcp.checkpoints, lambda: self.dcp.state()[0], self.dcp.refuse)
        resume = agree_on_resume(
            self.env.rank,
            device,
            self.local,
            durable,
            group=self.checkpoint_group,
            into=self.dcp.resolved(),  # received in place: the state is held once
        )
        if resume.state is None and self.cfg.checkpoint.init_from:  # collectives: no lock
            self._initialize_from(self.cfg.checkpoint.init_from)
        with self._state_lock:
            if resume.state is not None:
                self.dcp.apply(resume.state)
            self.dcp.mark_boundary()
            self.restored = True
        if resume.source == "durable":
            self.committed.advance(resume.step)
        elif resume.source == "local":
            # The step lives only on the nodes' disks: commit it now, in the background, so
            # an eviction of every node before the next periodic save does not lose it. Every
            # rank writes its share: the same ``resume`` on each, so all submit together.
            self.saver.submit(resume.step, self.dcp.snapshot())
        return resume

    # -- checkpoints ----------------------------------------------------------------------------
    def _on_saved(self, entry: Entry, seconds: float) -> None:
        self.committed.advance(entry.step)
        self.events.event(
            "checkpoint_saved",
            step=entry.step,
            bytes=entry.size,
            seconds=round(seconds, 4),
            stall_s=round(self._stalls.pop(entry.step, 0.0), 6),
            name=entry.name,
        )

    def _on_save_failed(self, step: int, error: BaseException, in_a_row: int) -> None:
        self._stalls.pop(step, None)
        report_failure(self.events, step, error, in_a_row, self.committed.step, self.state.step)

    def maybe_save(self, last: list[float]) -> None:
        """Every rank: snapshot its share in the loop (the stall), write it in the background
        (``ShardedState.maybe_save``)."""
        self.dcp.maybe_save(last)

    def emergency_save(self, reason: str, stop: StopRequest | None = None) -> Outcome | None:
        """Save the last completed step before exiting: node-local, then durable when the node
        is going away (training/loop/saves/emergency.py says who commits when, and the deadline)."""

        def stopping() -> bool:  # asked more than once: a SIGTERM may come in the middle
            requested = reason == "sigterm" or (stop is not None and stop.requested)
            if requested:
                self.emergency.note_stop(stop.at if stop is not None else None)
            return requested or self.env.last_round

        if self.sharded is not None:  # every rank its own part
            return self.sharded.emergency_save(reason, stopping)
        # A CPU copy read on a stream of its own: on NCCL the default stream may be stuck.
        # Of the state as the main thread resolved it at the last step's end, never here.
        step, state = self.dcp.boundary()
        return self.emergency.save(step, lambda: cpu_state(state), reason, stopping)

    def stop_now(self, stop: StopRequest) -> None:
        """SIGTERM, on the stop thread: save the last completed step and end the process now.

        The loop may be stuck in a collective on a frozen peer, which only the collective
        timeout (30 s in the cluster) would end, and the agent restarting the group waits for
        it: so nobody waits for the loop, except a step this rank is applying, and under FSDP2 a
        vote in flight (its peers may apply the step, and every shard must hold it): the save
        waits for it, within the deadline. Any other step in flight
        is abandoned, and this rank's no keeps every peer from applying it (``StepGate``).
        """
        code = WORKER_RESTART
        use_device(self.device)  # this thread's copies on this process's GPU, not GPU 0
        with _EXIT_LOCK:
            try:
                deadline = self.emergency.note_stop(stop.at)  # it runs from the signal
                if not self.gate.claim(deadline.remaining()):
                    logger.error("step %d was still being applied at the deadline", self.state.step)
                outcome = None
                with self._state_lock:
                    if self.restored and self.cfg.checkpoint.emergency_saves:
                        outcome = self.emergency_save("sigterm", stop)
                    elif self.cfg.checkpoint.emergency_saves:
                        outcome = self.emergency.commit_leftover()
                code = stop_exit_code(outcome)
            except BaseException:  # os._exit below drops it unprinted: say it first
                logger.exception("the stop's save of step %d failed", self.state.step)
                raise
            finally:  # whatever happened, the process ends: the agent is waiting for it
                self.events.close(self.emergency.note_stop())  # the run's records, in time
                exit_now(code)


def stop_exit_code(outcome: Outcome | None) -> int:
    """A stopped worker's code: RETRY_ME when its required durable commit gave up."""
    return WORKER_RESTART if outcome is None or outcome.complete else RETRY_ME


def wait_for_stop() -> None:
    """Return unless a SIGTERM save runs (a daemon thread, which ends the process itself)."""
    with _EXIT_LOCK:
        pass


def exit_now(code: int) -> None:
    """End the process with ``code``, the logs flushed, skipping gloo's teardown (see main),
    once no SIGTERM save runs on the stop thread (one that runs ends the process itself)."""
    with _EXIT_LOCK:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
