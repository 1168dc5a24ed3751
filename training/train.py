"""The elastic training loop. Run under ``torchrun`` (any rendezvous backend) or plain python.

restore (rank agreement) -> wrap in DDP -> ``while step < max_steps: train_step; maybe_save``.
On SIGTERM (spot eviction notice, pod deletion, torchrun restarting the group) the worker
finishes the step in flight, saves, and exits. When a collective fails because a peer vanished,
every survivor still holds the state of the last completed step (gradients are all-reduced
inside ``backward()``, before ``optimizer.step()``), so it saves that to node-local disk and
exits; the next round resumes from it and no completed step is lost.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from training.checkpoint import (
    BackgroundSaver,
    CheckpointRepository,
    Entry,
    SavePolicy,
    serialize,
    snapshot,
)
from training.config import ConfigError, TrainConfig, parse_config
from training.data import DatasetError, ImageDataset, batch_tensors, load_cifar10_binary
from training.dist import DistEnv, destroy_process_group, device_for, init_process_group
from training.metrics import EventLog, Phases, progress_line, setup_logging
from training.model import ModelConfig, build_model
from training.resume import NodeLocalState, Resume, agree_on_resume
from training.sampler import ElasticSampler, loss_scale, micro_batches
from training.storage import open_store

logger = logging.getLogger("training")

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_RESTART = 75  # state saved; torchrun starts a new round (EX_TEMPFAIL)

_PEER_FAILURE_MARKERS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "timed out",
    "broken pipe",
)


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because a peer died or froze (not a bug in this process)."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(
        m in str(exc).lower() for m in _PEER_FAILURE_MARKERS
    )


class StopRequest:
    """Turns SIGTERM into a flag the loop checks at every step boundary."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


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
    ) -> None:
        self.cfg, self.env, self.device, self.dataset = cfg, env, device, dataset
        self.durable, self.local, self.events = durable, local, events
        torch.manual_seed(cfg.run.seed)  # same init on every rank, before any restore
        self.model = build_model(ModelConfig(cfg.model.model_width, cfg.model.model_blocks)).to(
            device
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
        self.saver = BackgroundSaver(durable, self._on_saved)
        self._stalls: dict[int, float] = {}
        self.ddp: DistributedDataParallel | None = None
        self.last_loss: float | None = None

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
            "run": {
                "global_batch_size": self.cfg.optim.global_batch_size,
                "seed": self.cfg.run.seed,
                "model_width": self.cfg.model.model_width,
                "model_blocks": self.cfg.model.model_blocks,
            },
            "rng": {"torch": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()["run"]
        if state["run"] != mine:
            raise ConfigError(
                f"the checkpoint was written with {state['run']}, this run has {mine}; "
                "use a new --checkpoint-uri or the checkpoint's settings"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.state.step = int(state["trainer"]["step"])
        torch.set_rng_state(state["rng"]["torch"])

    def restore(self) -> Resume:
        resume = agree_on_resume(self.env.rank, self.device, self.local, self.durable)
        if resume.state is not None:
            self.load_state_dict(resume.state)
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
        """One global batch: this rank's share, in micro-batches; returns (loss sum, samples)."""
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
                    self.ddp(x.to(self.device)), y.to(self.device), reduction="sum"
                )
                (loss * scale).backward()
            loss_sum += float(loss.detach())
        self.optimizer.step()
        return loss_sum, len(indices)

    # -- checkpoints ----------------------------------------------------------------------------
    def _on_saved(self, entry: Entry, seconds: float) -> None:
        self.events.event(
            "checkpoint_saved",
            step=entry.step,
            bytes=entry.size,
            seconds=round(seconds, 4),
            stall_s=round(self._stalls.pop(entry.step, 0.0), 6),
            name=entry.name,
        )

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

    def emergency_save(self, reason: str) -> None:
        """Save the last completed step before exiting: node-local always, durable on SIGTERM."""
        started = time.monotonic()
        durable = reason == "sigterm" and self.env.rank == 0
        if self.env.rank == 0:
            self.saver.wait()  # a committed save in flight is worth finishing
        if self.env.local_rank != 0 and not durable:
            return
        data = serialize(self.state_dict())
        if self.local is not None and self.env.local_rank == 0:
            self.local.save(self.state.step, data)
        if durable:
            self.durable.commit(self.state.step, data)
        self.events.event(
            "emergency_save",
            step=self.state.step,
            reason=reason,
            seconds=round(time.monotonic() - started, 4),
            durable=durable,
        )

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop: StopRequest, phases: Phases) -> int:
        try:
            self.restore()
            phases.mark("restore")
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            self.events.event("peer_failure", step=self.state.step, error=str(exc)[:200])
            return EXIT_RESTART  # nothing restored yet, so nothing to save
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        phases.mark("ddp")
        if self.env.rank == 0:
            self.events.event(
                "ready", step=self.state.step, seconds=phases.total(), phases=phases.durations
            )
        max_steps, log_every = self.cfg.run.max_steps, self.cfg.run.log_every
        last_save = [float(self.state.step), time.monotonic()]
        window_start, window_steps, window_loss = time.monotonic(), 0, [0.0, 0.0]
        while self.state.step < max_steps:
            if stop.requested:
                if self.cfg.checkpoint.emergency_saves:
                    self.emergency_save("sigterm")
                return EXIT_RESTART
            try:
                loss_sum, count = self.train_step()
                self.state.step += 1
                if self.local is not None and self.env.local_rank == 0:
                    self.local.mark_progress(self.state.step)
                window_steps += 1
                window_loss[0] += loss_sum
                window_loss[1] += count
                if self.state.step % log_every == 0 or self.state.step == max_steps:
                    self._log(window_loss, window_steps, time.monotonic() - window_start)
                    window_start, window_steps, window_loss = time.monotonic(), 0, [0.0, 0.0]
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                self.events.event("peer_failure", step=self.state.step, error=str(exc)[:200])
                if self.cfg.checkpoint.emergency_saves:
                    self.emergency_save("peer_failure")
                return EXIT_RESTART
            self.maybe_save(last_save)
        try:
            self.finish()
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            return EXIT_RESTART  # the final state is committed; the next round ends at once
        return EXIT_OK

    def _log(self, window_loss: list[float], steps: int, seconds: float) -> None:
        totals = torch.tensor(window_loss, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)  # global mean loss over the window, only at log steps
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
        """Rank 0 commits the final state; every rank waits so none exits while others save."""
        if self.env.rank == 0:
            self.saver.wait()
            head = self.durable.head()
            if head is None or head.step < self.state.step:
                self.durable.commit(self.state.step, serialize(self.state_dict()))
            self.events.event("finished", step=self.state.step, loss=self.last_loss)
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    phases = Phases()
    env = DistEnv.from_env()
    setup_logging(env)
    stop = StopRequest()
    events = EventLog(env)
    try:
        cfg = parse_config(argv)
        dataset = load_cifar10_binary(cfg.data.data_dir)
        durable = CheckpointRepository(
            open_store(cfg.checkpoint.checkpoint_uri), keep=cfg.checkpoint.checkpoint_keep
        )
        durable.head()  # fail here, before any collective, if the store is unreachable
        local = NodeLocalState(cfg.checkpoint.local_dir, env.run_id)
    except (ConfigError, DatasetError, ValueError, OSError) as exc:
        logger.error("%s", exc)
        return EXIT_BAD_INPUT
    phases.mark("inputs")
    logger.info("config %s", cfg.as_dict())
    events.event(
        "started", world_size=env.world_size, local_rank=env.local_rank, group_rank=env.group_rank
    )
    device = device_for(env)
    init_process_group(env, device, cfg.run.collective_timeout_s)
    phases.mark("process_group")
    code = EXIT_OK
    try:
        trainer = Trainer(cfg, env, device, dataset, durable, local, events)
        phases.mark("build")
        code = trainer.run(stop, phases)
    except ConfigError as exc:
        logger.error("%s", exc)
        code = EXIT_BAD_INPUT
    finally:
        if not env.launched:
            destroy_process_group()
    if env.launched:
        # Skip gloo's teardown under torchrun: it aborts ("terminate called without an active
        # exception") when a peer is dead, or when rank 0, which hosts the workers' store,
        # has already exited. All state is saved by now; the exit code is what counts.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
