"""The elastic training loop: restore, wrap in DDP, ``while step < max_steps: train_step;
maybe_save``, finish.

On SIGTERM (spot eviction notice, pod deletion, torchrun restarting the group) the worker
finishes the step in flight, saves, and exits. When a collective fails because a peer vanished,
every survivor still holds the state of the last completed step (on gloo the gradient
all-reduce fails inside ``backward()``; on NCCL the step guard raises after it; both before
``optimizer.step()``: training/loop/step_guard.py), so it saves that to node-local disk and
exits; the next round resumes from it and no completed step is lost. Whenever a stop was
requested, rank 0 also commits that state durably: the node-local disk may go with the pod.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.api import EvalContext, MicroBatch
from training.checkpoints.checkpoint import CheckpointError
from training.data.sampler import loss_scale, micro_batches
from training.elastic.exit_codes import OK, WORKER_RESTART
from training.elastic.faults import PeerLostError, StopRequest, is_peer_failure
from training.elastic.permit import Pauses, Permit
from training.loop.evaluation import evaluate
from training.loop.metrics import Phases, progress_line
from training.loop.parallel import (
    clip_to_norm,
    compile_model,
    gradient_norm,
    gradient_sync,
    wrap_model,
)
from training.loop.saves.emergency import Outcome
from training.loop.step.losses import StepLosses, normalize_gradients, split_loss
from training.loop.step_guard import abort_collectives, mark_state_written
from training.loop.task_checks import checked_loss, rehearse_resume
from training.loop.trainer_state import StatefulTrainer, stop_exit_code

logger = logging.getLogger("training")


class Trainer(StatefulTrainer):
    """The loop over a ``StatefulTrainer``'s state: one optimiser step at a time, its log lines,
    the failures it survives and the final commit."""

    ddp: nn.Module | None = None
    """The model as the step runs it, once the state is restored: in DDP, or the model
    itself under FSDP2 (training/loop/parallel/wrap.py)."""
    last_loss: float | None = None
    """The global mean loss at the last log step (rank 0)."""
    last_eval_loss: float | None = None
    """The validation loss of the last evaluation (rank 0)."""
    _stopped: Outcome | None = None
    """The loop's emergency save when a stop ended it."""
    _stop: StopRequest | None = None
    permit: Permit | None = None
    """The agent's permit to apply a step (training/elastic/permit.py); None: not held."""
    pauses: Pauses | None = None
    """This process's own pauses: a permit that ran out holds only a worker paused too."""
    applied_ts: float = 0.0
    """The wall time the last step was let through to apply (its permit held, nothing between
    that and its optimizer step): its metrics line may be written much later (a node paused
    inside the step or the log's collective)."""

    # -- one optimiser step --------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """One global batch: this rank's share, in micro-batches, and the optimiser step;
        returns (loss sum, samples or the loss's count)."""
        assert self.ddp is not None
        step, world, rank = self.state.step, self.env.world_size, self.env.rank
        indices = self.sampler.rank_indices(step, world, rank)
        scale = loss_scale(len(indices), world, self.cfg.optim.global_batch_size)
        chunks = micro_batches(len(indices), self.cfg.optim.micro_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        losses = StepLosses(self.spec.name)
        for i, (offset, size) in enumerate(chunks):
            # DDP all-reduces the gradients on the last micro-batch only (parallel/wrap.py).
            with gradient_sync(self.ddp, i == len(chunks) - 1):
                self._backward(self.ddp, indices[offset : offset + size], scale, losses)
        # On NCCL, backward() returns even when a peer left mid all-reduce: nothing reads the
        # gradients before this rank's all-reduce finished, and none applies them unless
        # every rank's did (the vote).
        settled = self.guard.settle()
        # A (sum, count) loss: the counts of every rank, then the gradient over their total.
        normalize_gradients(self.model.parameters(), losses, world, self.guard.all_reduce)
        norm = self._reduce_gradients()
        self._hold_permit()
        # Every rank applies the step or none does (training/loop/step_guard.py): a rank whose
        # stop claimed the state votes no, and one applying the step finishes it before its
        # stop's save reads the state (under FSDP2 from its vote on: ``StepGate``).
        applies = self.gate.enter()
        try:
            self.guard.vote(applies and settled)
            # A pause inside the vote leaves the permit run out: hold it again with nothing
            # between it and the step (a worker alone in a round the run left steps in none).
            let_through = self._hold_permit()
            if not self.gate.applying():
                raise PeerLostError(f"stopped during the vote on step {self.state.step + 1}")
            with self._state_lock:
                self._apply_gradients(norm)
                self.state.step += 1
                self.applied_ts = let_through
                if self.local is not None and self.env.local_rank == 0:
                    self.local.mark_progress(self.state.step)
                self.dcp.mark_boundary()
        finally:
            self.gate.leave()
        return losses.total(), losses.count  # read once the step is applied

    def _hold_permit(self) -> float:
        """Wait, before the step changes the state, while the agent has not confirmed this
        round lately: a paused node that came back may be in a round the run left. A stop
        while held is a lost peer's (the last completed step is saved). Returns the wall time
        the step was let through."""
        if self.permit is None:
            return time.time()

        def waiting(lapsed_s: float) -> None:
            self.events.event("permit_wait", step=self.state.step, lapsed_s=round(lapsed_s, 3))
            logger.warning(
                "step %d waits for its agent to confirm round %s (its permit ran out %.1f s ago)",
                self.state.step + 1,
                self.env.rdzv_round,
                lapsed_s,
            )

        stop = self._stop
        held = self.permit.hold(lambda: stop is not None and stop.requested, waiting, self.pauses)
        if held is None:
            raise PeerLostError(f"stopped while step {self.state.step + 1} waited for a permit")
        return held

    def micro_batch(self, indices: torch.Tensor) -> MicroBatch:
        step = self.state.step
        return MicroBatch(
            indices, step, self.sampler.epoch_of(step), self.cfg.run.seed, self.device
        )

    def _backward(
        self, model: nn.Module, indices: torch.Tensor, scale: float, losses: StepLosses
    ) -> None:
        """The task's loss of one micro-batch, backward; its value added to ``losses``. A sum
        over samples is scaled by ``scale``; a (sum, count) one after the step's last
        micro-batch (training/loop/step/losses.py)."""
        where = self.micro_batch(indices)
        items = self.loader.items(self.state.step, indices)  # read ahead by loader threads
        batch = _to_device(self.spec.collate(items, where), self.device, self.dtype)
        with self.precision.autocast():  # forward and loss (--precision)
            value = checked_loss(self.spec.loss, self.spec.name, model, batch, where)
        loss, count = split_loss(value)
        self.precision.backward(loss if count is not None else loss * scale)
        losses.add(loss, count, len(indices))

    def _reduce_gradients(self) -> torch.Tensor | None:
        """The step's collectives after the gradients' own, all before the vote: fp16's
        overflow check (``unscale``: clip the gradients, not the scaled ones) and the norm
        the clip scales by (reduced over a sharded model's ranks); None: no clip."""
        self.precision.unscale(self.optimizer)
        if not self.parts.max_grad_norm:
            return None
        return gradient_norm(self.model.parameters())

    def _apply_gradients(self, norm: torch.Tensor | None) -> None:
        """Clip (the gradients are the global batch's, the same on every rank), step, schedule:
        no collective, every rank voted to apply the step."""
        if norm is not None and self.parts.max_grad_norm:
            clip_to_norm(self.model.parameters(), self.parts.max_grad_norm, norm)
        self.precision.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        for extra in self.extras.values():  # an EMA follows the step it averages
            extra.update(self.model)
        # Freed now, not at the next step: a save between steps then holds the state without
        # the gradients (with FSDP2 and AdamW, a quarter of a rank's memory for its state).
        self.optimizer.zero_grad(set_to_none=True)
        mark_state_written(self.device)  # a save's GPU copy waits for these kernels

    def rehearse_resume(self) -> None:
        """The API's check that the task keeps no state outside the checkpoint
        (training/loop/task_checks.py): this rank's first micro-batch, twice, no step."""
        indices = self.sampler.rank_indices(self.state.step, self.env.world_size, self.env.rank)
        first = indices[: self.cfg.optim.micro_batch_size]
        scale = loss_scale(len(indices), self.env.world_size, self.cfg.optim.global_batch_size)

        def one_pass() -> float:
            self.optimizer.zero_grad(set_to_none=True)
            losses = StepLosses(self.spec.name)
            self._backward(self.model, first, scale, losses)
            normalize_gradients(self.model.parameters(), losses, 1, None)  # local: no collective
            return losses.total()

        with self._state_lock:
            seconds = rehearse_resume(
                self.spec.name,
                self.small_state,
                self.load_small_state,
                one_pass,
                self.model,
                self.optimizer,
            )
        if self.env.rank == 0:
            logger.info("resume check: two passes of one micro-batch in %.3f s", seconds)

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop: StopRequest, phases: Phases) -> int:
        """Restore, train to ``max_steps`` and finish; WORKER_RESTART after a stop or lost peer."""
        try:
            self.restore()
            phases.mark("restore")
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            return self._after_failure("peer_failure", exc, stop, restored=False)
        try:
            if self.cfg.run.resume_check:
                self.rehearse_resume()
                phases.mark("resume_check")
            self._wrap(phases)
            if not self._train(stop):
                return stop_exit_code(self._stopped)
            self.finish()
        except Exception as exc:
            if is_peer_failure(exc):
                return self._after_failure("peer_failure", exc, stop, restored=True)
            if isinstance(exc, OSError | CheckpointError):
                # E.g. the store failed the final commit: keep the steps on the node and let
                # torchrun retry, rather than crash and fall back to the last periodic save.
                return self._after_failure("storage_failure", exc, stop, restored=True)
            raise
        finally:
            self.loader.close()  # its threads read no further ahead
        return OK

    def _after_failure(
        self, kind: str, exc: BaseException, stop: StopRequest, restored: bool
    ) -> int:
        self.events.event(kind, step=self.state.step, error=str(exc)[:200])
        if kind == "peer_failure":
            abort_collectives()  # NCCL kernels stuck on the lost peer return
        if restored and self.cfg.checkpoint.emergency_saves:
            return stop_exit_code(self.emergency_save(kind, stop))
        return WORKER_RESTART

    def _wrap(self, phases: Phases) -> None:
        """The parallelism's wrap step: DDP, or nothing more for a sharded model."""
        parallelism, stream = self.cfg.run.parallelism, self.guard.stream
        if self.cfg.run.compile:  # in place, after the resume rehearsal, which stays eager
            compile_model(self.model, parallelism)
        self.ddp = wrap_model(self.model, parallelism, self.device, stream)
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
        self._stop, self.permit = stop, Permit.of_worker()
        self.pauses = Pauses.of_process() if self.permit is not None else None
        log_every = self.cfg.run.log_every
        last_save = [float(self.state.step), time.monotonic()]
        window_start, window_steps, window_loss = time.monotonic(), 0, [0.0, 0.0]
        while self.state.step < (max_steps := self._max_steps()):
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
                self._note_completed()
                self._log(window_loss, window_steps, time.monotonic() - window_start)
                window_start, window_steps, window_loss = time.monotonic(), 0, [0.0, 0.0]
            if self._eval_due():
                self.evaluate()
                with self._state_lock:  # the RNG streams as the next step starts from them
                    self.dcp.mark_boundary()
            self.maybe_save(last_save)
            # Lab pacing: a fault schedule in steps then means the same on a fast machine.
            time.sleep(max(self.cfg.run.min_step_time_s - (time.monotonic() - step_started), 0))
        return True

    def _max_steps(self) -> int:
        """``--max-steps``, raised by the count in ``--max-steps-file`` when there is one. Read
        every step: the ranks agree because the local lab only ever writes a count well ahead
        of the step they are at, so each reads it before it could stop at the old end."""
        path = self.cfg.run.max_steps_file
        if path:
            try:
                raised = int(Path(path).read_text())
            except (OSError, ValueError):  # not written yet: the flag's count holds
                raised = 0
            self.cfg.run.max_steps = max(self.cfg.run.max_steps, raised)
        return self.cfg.run.max_steps

    def _note_completed(self) -> None:
        """Every node says which step it completed, not only rank 0's (its metrics line): a
        node lost right after a step rank 0's node never logged still shows it in its own log,
        which the chaos campaign counts lost steps from (bench/chaos/invariants.py)."""
        if self.env.local_rank == 0 and self.env.rank != 0:
            self.events.event(
                "step_completed",
                step=self.state.step,
                world_size=self.env.world_size,
                applied_ts=round(self.applied_ts, 3),
            )

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
            applied_ts=round(self.applied_ts, 3),
        )
        logger.info(
            progress_line(
                self.state.step, self.cfg.run.max_steps, epoch, self.env.world_size, loss, rate
            )
        )

    def _eval_due(self) -> bool:
        every = self.cfg.run.eval_every
        return bool(every) and self.spec.evaluate is not None and self.state.step % every == 0

    def evaluate(self) -> None:
        """The task's evaluation, summed over the ranks; rank 0 logs it."""
        ctx = EvalContext(
            self.state.step,
            self.cfg.run.seed,
            self.device,
            self.env.rank,
            self.env.world_size,
            self.cfg.options,
        )
        with self.precision.autocast():
            result = evaluate(self.spec, self.model, self.data, ctx, self.guard.all_reduce)
        if result is not None and self.env.rank == 0:
            self.last_eval_loss = result["eval_loss"]
            self.events.event(
                "evaluated", step=self.state.step, world_size=self.env.world_size, **result
            )
            logger.info(
                "eval at step %d: loss %.4f%s",
                self.state.step,
                result["eval_loss"],
                f" | {result['sample']!r}" if "sample" in result else "",
            )

    def finish(self) -> None:
        """Every rank saves its part of the final state unless it is durable already
        (``ShardedState.finish``: a collective on the checkpoint group, whose timeout allows
        for a slow store); then every rank waits so none exits while others save."""
        self.dcp.finish()
        if self.env.rank == 0:
            self.events.event(
                "finished", step=self.state.step, loss=self.last_loss, eval_loss=self.last_eval_loss
            )
        dist.barrier(group=self.checkpoint_group)


def _to_device(batch: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A collated batch on the device: floating tensors in the run's dtype, others as they are."""
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point():
            return batch.to(device, dtype)
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, dtype) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(v, device, dtype) for v in batch)
    return batch
