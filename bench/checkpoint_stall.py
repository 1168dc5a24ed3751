"""How long a checkpoint blocks the training loop: inline save vs the lab's snapshot.

Measured in this process with the real trainer and the real checkpoint code
(``torch.distributed.checkpoint`` under the commit protocol), writing to a local directory:

- ``sync``: write the state and commit it (files, checksums, manifest) inline, the way a plain
  recipe calls ``torch.save`` or ``dcp.save`` in the loop;
- ``lab``: what ``Trainer.maybe_save`` times as its stall, a CPU snapshot of the rank's share
  of the state; the background thread then writes and commits it while training goes on.

Each is given as a fraction of one optimiser step of the same model: one rank's share of the
global batch at the given world size, on one thread like a lab node.
"""

from __future__ import annotations

import dataclasses
import io
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from training.checkpoints.storage import FileStore
from training.loop.config import parse_config
from training.loop.dist import DistEnv, destroy_process_group, init_process_group
from training.loop.inputs import load_data
from training.loop.metrics import EventLog
from training.loop.trainer import Trainer


@dataclass(frozen=True)
class StallModel:
    """A model size to measure."""

    name: str
    width: int
    blocks: int


STALL_MODELS = (StallModel("lab default", 16, 2), StallModel("larger", 64, 2))


@dataclass(frozen=True)
class StallPlan:
    """How the stall is measured."""

    models: tuple[StallModel, ...] = STALL_MODELS
    global_batch_size: int = 256
    world_size: int = 2
    """A step is one rank's share: ``global_batch_size / world_size`` samples."""
    micro_batch_size: int = 64
    steps: int = 3
    """Timed optimiser steps (after one untimed warm-up step)."""
    saves: int = 5
    """Timed saves per method."""

    def validate(self) -> None:
        """Raise ValueError naming the setting that is out of range."""
        for name in ("global_batch_size", "world_size", "micro_batch_size", "steps", "saves"):
            if getattr(self, name) < 1:
                raise ValueError(f"stall {name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size < self.world_size:
            raise ValueError("stall global_batch_size must be >= world_size")
        if not self.models:
            raise ValueError("stall models: measure at least one model")


@contextmanager
def _single_process_trainer(
    model: StallModel, plan: StallPlan, data_dir: Path, work: Path
) -> Iterator[Trainer]:
    """A real Trainer in a one-process gloo group, its checkpoints in ``work``."""
    cfg = parse_config(
        [
            f"--data-dir={data_dir}",
            f"--checkpoint-uri={work / 'checkpoints'}",
            f"--model-width={model.width}",
            f"--model-blocks={model.blocks}",
            f"--global-batch-size={plan.global_batch_size // plan.world_size}",
            f"--micro-batch-size={plan.micro_batch_size}",
        ],
        env={},
    )
    env = DistEnv()
    device = torch.device("cpu")
    store = FileStore(cfg.checkpoint.checkpoint_uri)
    init_process_group(env, device, timeout_s=60)
    try:
        events = EventLog(env, stream=io.StringIO())  # the saver's events are not needed here
        trainer = Trainer(cfg, env, device, load_data(cfg), store, None, events)
        trainer.ddp = DistributedDataParallel(trainer.model)
        yield trainer
    finally:
        destroy_process_group()


def _timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _sync_save(trainer: Trainer) -> None:
    """The checkpoint written in the loop, as a plain training script would."""
    trainer.dcp.checkpoints.save(trainer.dcp.state()[0], trainer.state.step)


def _lab_save(trainer: Trainer) -> tuple[float, float]:
    """(stall, background write) seconds of one save the way the training loop does it."""
    started = time.perf_counter()
    state = trainer.dcp.snapshot()
    stall = time.perf_counter() - started
    trainer.saver.submit(trainer.state.step, state)
    trainer.saver.wait()
    return stall, time.perf_counter() - started - stall


def measure_model(model: StallModel, plan: StallPlan, data_dir: Path) -> dict[str, Any]:
    """Step time and both kinds of stall for one model size."""
    with (
        tempfile.TemporaryDirectory(prefix="bench-stall-") as work,
        _single_process_trainer(model, plan, data_dir, Path(work)) as trainer,
    ):
        trainer.train_step()  # warm-up: first-call allocations, optimiser state
        step_s = statistics.median(_timed(trainer.train_step) for _ in range(plan.steps))
        sync_s = statistics.median(_timed(lambda: _sync_save(trainer)) for _ in range(plan.saves))
        lab = [_lab_save(trainer) for _ in range(plan.saves)]
        head = trainer.dcp.checkpoints.head()
        assert head is not None
        size = head.size + sum(f.size for f in head.files)
        if trainer.saver.error is not None:
            raise RuntimeError(f"a background checkpoint failed: {trainer.saver.error}")
    lab_s = statistics.median(stall for stall, _ in lab)
    return {
        "model": model.name,
        "model_width": model.width,
        "model_blocks": model.blocks,
        "checkpoint_bytes": size,
        "step_s": round(step_s, 5),
        "sync_stall_s": round(sync_s, 5),
        "lab_stall_s": round(lab_s, 6),
        "lab_background_write_s": round(statistics.median(write for _, write in lab), 5),
        "sync_fraction_of_step": round(sync_s / step_s, 4),
        "lab_fraction_of_step": round(lab_s / step_s, 4),
    }


def measure_checkpoint_stall(plan: StallPlan, data_dir: Path) -> dict[str, Any]:
    """Every model in ``plan``, on one thread (the lab gives each node one)."""
    plan.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [measure_model(model, plan, data_dir) for model in plan.models]
    finally:
        torch.set_num_threads(threads)
    return {
        "plan": dataclasses.asdict(plan),
        "models": models,
    }
