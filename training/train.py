"""The elastic training loop. Run under ``torchrun`` (any rendezvous backend) or plain python.

restore (rank agreement) -> wrap in DDP -> ``while step < max_steps: train_step; maybe_save``.
On SIGTERM (spot eviction notice, pod deletion, torchrun restarting the group) the worker
finishes the step in flight, saves, and exits. When a collective fails because a peer vanished,
every survivor still holds the state of the last completed step (on gloo the gradient
all-reduce fails inside ``backward()``; on NCCL the step guard raises after it; both before
``optimizer.step()``: training/step_guard.py), so it saves that to node-local disk and exits;
the next round resumes from it and no completed step is lost. Whenever a stop was requested,
rank 0 also commits that state durably: the node-local disk may go with the pod.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from training.checkpoint import CheckpointError, CheckpointRepository, Entry, serialize, snapshot
from training.config import ConfigError, TrainConfig
from training.data import DatasetError, ImageDataset, batch_tensors
from training.determinism import use_deterministic_algorithms
from training.dist import (
    DistEnv,
    destroy_process_group,
    device_for,
    init_process_group,
    new_checkpoint_group,
)
from training.emergency import EXIT_NOT_DURABLE, DurableProgress, EmergencySave, Outcome
from training.exit_codes import WORKER_RESTART
from training.faults import StopRequest, is_peer_failure
from training.inputs import STORAGE_KEY, load_inputs, run_identity
from training.metrics import EventLog, Phases, progress_line, setup_logging
from training.model import ModelConfig, build_model
from training.periodic_save import BackgroundSaver, SavePolicy, report_failure
from training.resume import NodeLocalState, Resume, agree_on_resume
from training.sampler import ElasticSampler, loss_scale, micro_batches
from training.step_guard import (
    EmulatedStream,
    StepGuard,
    abort_collectives,
    cpu_state,
    stream_ordered_allreduce_hook,
)

logger = logging.getLogger("training")

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_RESTART = WORKER_RESTART  # state saved; torchrun starts a new round
# Whatever runs the worker's exit: the SIGTERM thread holds it while it saves, so the main
# thread, done with the loop, cannot end the process under a durable commit in flight.
_EXIT_LOCK = threading.RLock()


@dataclass
class TrainerState:
    """The loop's own position; the data position derives from the step alone."""

    step: int = 0


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        dataset: ImageDataset,
        durable: CheckpointRepository,
        local: NodeLocalState | None,
        events: EventLog,
        checkpoint_group: dist.ProcessGroup | None = None,
        guard: StepGuard | None = None,
    ) -> None:
        """``checkpoint_group`` carries the collectives that wait on storage (restore, finish);
        None uses the default group. ``guard`` checks every step before ``optimizer.step()``
        where the gradient all-reduce may complete without a lost peer (NCCL)."""
        self.cfg, self.env, self.device, self.dataset = cfg, env, device, dataset
        self.durable, self.local, self.events = durable, local, events
        self.checkpoint_group = checkpoint_group
        self.guard = guard or StepGuard(None)
        self.identity = run_identity(cfg, dataset)
        torch.manual_seed(cfg.run.seed)  # same init on every rank, before any restore
        self.dtype: torch.dtype = getattr(torch, cfg.run.dtype)
        self.model = build_model(ModelConfig(cfg.model.model_width, cfg.model.model_blocks)).to(
            device=device, dtype=self.dtype
        )
        self.optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=cfg.optim.lr,
            momentum=cfg.optim.momentum,
            weight_decay=cfg.optim.weight_decay,
        )
        self.sampler = ElasticSampler(len(dataset), cfg.optim.global_batch_size, cfg.run.seed)
        self.state = TrainerState()
        self.policy = SavePolicy(
            cfg.checkpoint.checkpoint_every_steps, cfg.checkpoint.checkpoint_every_seconds
        )
        self.saver = BackgroundSaver(durable, self._on_saved, self._on_save_failed)
        self._stalls: dict[int, float] = {}
        self.committed = DurableProgress()
        self.emergency = EmergencySave(
            env,
            local,
            durable,
            self.saver,
            self.committed,
            events,
            cfg.checkpoint.stop_deadline_s,
        )
        self.ddp: DistributedDataParallel | None = None
        self.last_loss: float | None = None
        self.restored = False
        """Whether the state is this run's (restored or fresh): only then is it worth saving."""
        self._state_lock = threading.Lock()
        """Held while the state changes (restore, optimizer step, step count), never across a
        collective: whoever holds it sees the state of a completed step."""
        self._stopped: Outcome | None = None
        """The loop's emergency save when a stop ended it."""

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        step = self.state.step
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "trainer": {
                "step": step,
                "epoch": self.sampler.epoch_of(step),
                "consumed_samples": self.sampler.consumed_samples(step),
            },
            "run": dict(self.identity),
            "rng": {"torch": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theirs = {k: v for k, v in state["run"].items() if k != STORAGE_KEY}
        mine = {k: v for k, v in self.identity.items() if k != STORAGE_KEY}
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
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.state.step = int(state["trainer"]["step"])
        torch.set_rng_state(state["rng"]["torch"])

    def restore(self) -> Resume:
        # A gloo checkpoint group carries CPU tensors, whatever the default backend.
        device = self.device if self.checkpoint_group is None else torch.device("cpu")
        resume = agree_on_resume(
            self.env.rank, device, self.local, self.durable, group=self.checkpoint_group
        )
        with self._state_lock:
            if resume.state is not None:
                self.load_state_dict(resume.state)
            self.restored = True
        if resume.source == "durable":
            self.committed.advance(resume.step)
        elif resume.source == "local" and self.env.rank == 0:
            # The step lives only on the nodes' disks: commit it now, in the background, so
            # an eviction of every node before the next periodic save does not lose it.
            self.saver.submit(resume.step, snapshot(self.state_dict()))
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

    # -- one optimiser step --------------------------------------------------------------------
    def train_step(self) -> tuple[float, int]:
        """One global batch: this rank's share, in micro-batches, and the optimiser step;
        returns (loss sum, samples)."""
        assert self.ddp is not None
        step, world, rank = self.state.step, self.env.world_size, self.env.rank
        indices = self.sampler.rank_indices(step, world, rank)
        scale = loss_scale(len(indices), world, self.cfg.optim.global_batch_size)
        chunks = micro_batches(len(indices), self.cfg.optim.micro_batch_size)
        epoch = self.sampler.epoch_of(step)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i, (offset, size) in enumerate(chunks):
            x, y = batch_tensors(
                self.dataset, indices[offset : offset + size], seed=self.cfg.run.seed, epoch=epoch
            )
            # Gradients are all-reduced once per step, on the last micro-batch only.
            with self.ddp.no_sync() if i < len(chunks) - 1 else nullcontext():
                loss = F.cross_entropy(
                    self.ddp(x.to(self.device, self.dtype)), y.to(self.device), reduction="sum"
                )
                (loss * scale).backward()
            loss_sum += float(loss.detach())
        # On NCCL, backward() returns even when a peer left mid all-reduce: stop here, before
        # a half-reduced gradient changes the state every rank must agree on.
        self.guard.check()
        with self._state_lock:
            self.optimizer.step()
            self.state.step += 1
            if self.local is not None and self.env.local_rank == 0:
                self.local.mark_progress(self.state.step)
        return loss_sum, len(indices)

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
        """Rank 0 only: snapshot in the loop (the stall), write in the background."""
        now = time.monotonic()
        if self.env.rank != 0 or not self.policy.should_save(
            self.state.step, int(last[0]), last[1], now
        ):
            return
        started = time.perf_counter()
        state = snapshot(self.state_dict())
        self._stalls[self.state.step] = time.perf_counter() - started
        if self.saver.submit(self.state.step, state):
            last[0], last[1] = self.state.step, now

    def emergency_save(self, reason: str, stop: StopRequest | None = None) -> Outcome | None:
        """Save the last completed step before exiting: node-local, then durable when the node
        is going away (training/emergency.py says who commits when, and the deadline)."""

        def stopping() -> bool:  # asked more than once: a SIGTERM may come in the middle
            requested = reason == "sigterm" or (stop is not None and stop.requested)
            if requested:
                self.emergency.note_stop(stop.at if stop is not None else None)
            return requested or self.env.last_round

        # A CPU copy read on a stream of its own: on NCCL the default stream may be stuck.
        return self.emergency.save(
            self.state.step, lambda: cpu_state(self.state_dict()), reason, stopping
        )

    def stop_now(self, stop: StopRequest) -> None:
        """SIGTERM, on the stop thread: save the last completed step and end the process now.

        The loop may be stuck in a collective on a frozen peer, which only the collective
        timeout (30 s in the cluster) would end, and the agent restarting the group waits for
        it: so nobody waits for the loop. The step in flight is abandoned: the state lock
        gives the state of the last completed one, on every rank the same.
        """
        code = EXIT_RESTART
        with _EXIT_LOCK:
            try:
                self.emergency.note_stop(stop.at)  # the deadline runs from the signal
                outcome = None
                with self._state_lock:
                    if self.restored and self.cfg.checkpoint.emergency_saves:
                        outcome = self.emergency_save("sigterm", stop)
                    elif self.cfg.checkpoint.emergency_saves:
                        outcome = self.emergency.commit_leftover()
                code = _exit_code(outcome)
            finally:  # whatever happened, the process ends: the agent is waiting for it
                exit_now(code)

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop: StopRequest, phases: Phases) -> int:
        """Restore, train to ``max_steps`` and finish; EXIT_RESTART after a stop or lost peer."""
        try:
            self.restore()
            phases.mark("restore")
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            return self._after_failure("peer_failure", exc, stop, restored=False)
        try:
            self._wrap_in_ddp(phases)
            if not self._train(stop):
                return _exit_code(self._stopped)
            self.finish()
        except Exception as exc:
            if is_peer_failure(exc):
                return self._after_failure("peer_failure", exc, stop, restored=True)
            if isinstance(exc, OSError | CheckpointError):
                # E.g. the store failed the final commit: keep the steps on the node and let
                # torchrun retry, rather than crash and fall back to the last periodic save.
                return self._after_failure("storage_failure", exc, stop, restored=True)
            raise
        return EXIT_OK

    def _after_failure(
        self, kind: str, exc: BaseException, stop: StopRequest, restored: bool
    ) -> int:
        self.events.event(kind, step=self.state.step, error=str(exc)[:200])
        if kind == "peer_failure":
            abort_collectives()  # NCCL kernels stuck on the lost peer return
        if restored and self.cfg.checkpoint.emergency_saves:
            return _exit_code(self.emergency_save(kind, stop))
        return EXIT_RESTART

    def _wrap_in_ddp(self, phases: Phases) -> None:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        stream = self.guard.stream
        if isinstance(stream, EmulatedStream):  # NCCL's ordering on gloo (tests, the lab)
            # Gradients are views of the buckets, which the queued all-reduce fills later.
            self.ddp = DistributedDataParallel(
                self.model, device_ids=device_ids, gradient_as_bucket_view=True
            )
            self.ddp.register_comm_hook(stream, stream_ordered_allreduce_hook)
        else:
            self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        phases.mark("ddp")
        if self.env.rank == 0:
            self.events.event(
                "ready",
                step=self.state.step,
                seconds=phases.total(),
                phases=phases.durations,
                warm=phases.warm,
            )

    def _train(self, stop: StopRequest) -> bool:
        """Steps until ``max_steps`` (True) or a stop request (False, after saving)."""
        max_steps, log_every = self.cfg.run.max_steps, self.cfg.run.log_every
        last_save = [float(self.state.step), time.monotonic()]
        window_start, window_steps, window_loss = time.monotonic(), 0, [0.0, 0.0]
        while self.state.step < max_steps:
            if stop.requested:
                if self.cfg.checkpoint.emergency_saves:
                    self._stopped = self.emergency_save("sigterm", stop)
                return False
            step_started = time.monotonic()
            loss_sum, count = self.train_step()
            window_steps += 1
            window_loss[0] += loss_sum
            window_loss[1] += count
            if self.state.step % log_every == 0 or self.state.step == max_steps:
                self._log(window_loss, window_steps, time.monotonic() - window_start)
                window_start, window_steps, window_loss = time.monotonic(), 0, [0.0, 0.0]
            self.maybe_save(last_save)
            # Lab pacing: a fault schedule in steps then means the same on a fast machine.
            time.sleep(max(self.cfg.run.min_step_time_s - (time.monotonic() - step_started), 0))
        return True

    def _log(self, window_loss: list[float], steps: int, seconds: float) -> None:
        # The global mean loss over the window, only at log steps; on the guard's gloo group
        # where there is one, so a peer lost here fails it as in any other collective.
        totals = self.guard.all_reduce(torch.tensor(window_loss, dtype=torch.float64))
        if self.env.rank != 0:
            return
        loss = float(totals[0] / totals[1])
        self.last_loss = round(loss, 6)
        rate = steps * self.cfg.optim.global_batch_size / max(seconds, 1e-9)
        epoch = self.sampler.epoch_of(max(self.state.step - 1, 0))
        self.events.metrics(
            step=self.state.step,
            epoch=epoch,
            world_size=self.env.world_size,
            loss=round(loss, 6),
            samples_per_s=round(rate, 2),
            step_time_s=round(seconds / steps, 5),
        )
        logger.info(
            progress_line(
                self.state.step, self.cfg.run.max_steps, epoch, self.env.world_size, loss, rate
            )
        )

    def finish(self) -> None:
        """Rank 0 commits the final state; every rank waits so none exits while others save.

        The wait is on the checkpoint group: its timeout allows for a slow store.
        """
        if self.env.rank == 0:
            self.saver.wait()
            # The store, not this process's memory, says what is durable: another writer or a
            # damaged object may have changed it since this process last committed.
            durable = self.durable.newest_verified()
            if durable is None or durable.step < self.state.step:
                self.durable.commit(self.state.step, serialize(self.state_dict()))
            self.committed.advance(self.state.step)
            self.events.event("finished", step=self.state.step, loss=self.last_loss)
        dist.barrier(group=self.checkpoint_group)


def _checkpoint_group(cfg: TrainConfig, env: DistEnv) -> dist.ProcessGroup:
    started = time.monotonic()
    group = new_checkpoint_group(cfg.checkpoint.restore_timeout_s)
    seconds = round(time.monotonic() - started, 4)
    if env.rank == 0:  # one store round-trip and a gloo mesh: small, but measured
        logger.info("checkpoint group (gloo) created in %.4f s", seconds)
    return group


def _exit_code(outcome: Outcome | None) -> int:
    """A stopped worker's code: EXIT_NOT_DURABLE when its required durable commit gave up."""
    return EXIT_RESTART if outcome is None or outcome.complete else EXIT_NOT_DURABLE


def exit_now(code: int) -> None:
    """End the process with ``code``, the logs flushed, skipping gloo's teardown (see main).

    Waits for a SIGTERM save in progress on the stop thread, which ends the process itself.
    """
    with _EXIT_LOCK:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(argv: list[str] | None = None) -> int:
    """Train with ``argv``; the exit code. Under torchrun the process group is left to exit."""
    phases = Phases()
    env = DistEnv.from_env()
    setup_logging(env)
    # Under torchrun a SIGTERM acts at once, even mid-collective; nothing to save until the
    # trainer restored its state, so until then it only ends the process.
    stop = StopRequest(act_at_once=env.launched)
    stop.until_then(lambda: exit_now(EXIT_RESTART))
    events = EventLog(env)
    try:
        cfg, dataset, durable, local = load_inputs(argv, env)
    except (ConfigError, DatasetError) as exc:
        logger.error("%s", exc)
        return EXIT_BAD_INPUT
    phases.mark("inputs")
    logger.info("config %s", cfg.as_dict())
    if cfg.run.deterministic:  # before the device: cuBLAS reads its setting as CUDA starts
        logger.info("deterministic mode: %s", use_deterministic_algorithms())
    # The run's target, so a report built from the logs alone knows what "finished" means.
    events.event(
        "started",
        world_size=env.world_size,
        local_rank=env.local_rank,
        group_rank=env.group_rank,
        max_steps=cfg.run.max_steps,
        global_batch_size=cfg.optim.global_batch_size,
    )
    device = device_for(env)
    try:
        init_process_group(env, device, cfg.run.collective_timeout_s)
        group = _checkpoint_group(cfg, env)
        guard = StepGuard.create(dist.get_backend(), cfg.run.collective_timeout_s)
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        # A peer vanished while the group formed (its store timed out waiting for it): a lost
        # peer, like one in a collective, not a bug. Nothing was trained in this round.
        logger.warning("a peer left while the process group formed: %s", exc)
        return EXIT_RESTART
    phases.mark("process_group")
    code = EXIT_OK
    try:
        trainer = Trainer(cfg, env, device, dataset, durable, local, events, group, guard)
        stop.on_stop(lambda: trainer.stop_now(stop))
        phases.mark("build")
        code = trainer.run(stop, phases)
    except ConfigError as exc:
        logger.error("%s", exc)
        code = EXIT_BAD_INPUT
    except CheckpointError as exc:  # e.g. the store unreadable from every rank: retry later
        logger.error("%s", exc)
        code = EXIT_RESTART
    finally:
        if not env.launched:
            destroy_process_group()
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m training.train`` (torchrun's workers, or a single process)."""
    code = run(argv)
    if DistEnv.from_env().launched and dist.is_initialized():
        # Skip gloo's teardown under torchrun: it aborts ("terminate called without an active
        # exception") when a peer is dead, or when rank 0, which hosts the workers' store,
        # has already exited. All state is saved by now; the exit code is what counts.
        exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
