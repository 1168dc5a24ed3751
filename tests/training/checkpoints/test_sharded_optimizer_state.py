"""A sharded checkpoint of a model whose optimizer has no state yet, though steps were counted
(fp16's gradient scaler skips the first ones): it holds the optimizer's hyperparameters in
place of a state torch's ``get_state_dict`` would make up (a step-1 AdamW), and loads into a
fresh optimizer; a checkpoint with a state still loads it into a fresh one, as before."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch

from tests.support.trainer_harness import one_process_world
from training.checkpoints.sharded.reader import StoreReader
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import (
    HYPERPARAMETERS,
    ModelState,
    TrainerState,
    training_state,
)
from training.checkpoints.storage import FileStore


class Run:
    """A model, AdamW and a schedule that moves the rate every step."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1 / (s + 1))
        self.trainer = TrainerState(scheduler=self.scheduler)
        self.state = training_state(ModelState(self.model, self.optimizer), self.trainer)

    def step(self, skipped: bool) -> None:
        """One step; a skipped one as the scaler skips it: gradients, no optimizer step."""
        self.optimizer.zero_grad()
        self.model(torch.ones(2, 4)).sum().backward()
        if not skipped:
            self.optimizer.step()
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        self.trainer.step += 1


def _names(checkpoints: ShardedCheckpoints, scratch: Path) -> frozenset[str]:
    entry = checkpoints.entries()[0]
    return frozenset(
        StoreReader(checkpoints.store, entry, scratch).read_metadata().state_dict_metadata
    )


def test_a_save_before_the_optimizers_first_step_loads_into_a_fresh_optimizer(
    tmp_path: Path,
) -> None:
    with one_process_world():
        checkpoints = ShardedCheckpoints(FileStore(tmp_path / "store"), tmp_path / "scratch")
        saved = Run(seed=0)
        saved.step(skipped=True)
        saved.step(skipped=True)  # gradients left over: get_state_dict would not even fake it
        checkpoints.save(saved.state, 2)
        names = _names(checkpoints, tmp_path / "scratch")
        assert f"model.{HYPERPARAMETERS}" in names
        assert not any(n.startswith("model.optimizer.") for n in names), sorted(names)

        loaded = Run(seed=1)
        entry = checkpoints.load(loaded.state)
        assert entry is not None and loaded.trainer.step == 2
        assert not loaded.optimizer.state  # fresh: AdamW's first step will be its step 1
        assert loaded.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]
        assert loaded.optimizer.param_groups[0]["lr"] == 0.1 / 3  # the schedule's, not lr
        assert torch.equal(loaded.model.weight, saved.model.weight)
        # Both take their first step: the same update.
        saved.step(skipped=False)
        loaded.step(skipped=False)
        assert torch.equal(loaded.model.weight, saved.model.weight)

        checkpoints.save(saved.state, 3)  # now with a state: loaded as before
        names = _names(checkpoints, tmp_path / "scratch")
        assert f"model.{HYPERPARAMETERS}" not in names
        again = Run(seed=2)
        entry = checkpoints.load(again.state)
        assert entry is not None and entry.step == 3
        assert [int(s["step"]) for s in again.optimizer.state.values()] == [1, 1]
        assert torch.equal(again.model.weight, saved.model.weight)


def test_damaged_metadata_of_the_newest_falls_back_before_any_state_is_shaped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator reads each checkpoint's metadata for its names: one it cannot read is
    skipped on every rank alike, and the previous one loads (here, one holding no state)."""
    with one_process_world():
        store = FileStore(tmp_path / "store")
        checkpoints = ShardedCheckpoints(store, tmp_path / "scratch")
        saved = Run(seed=0)
        saved.step(skipped=True)
        checkpoints.save(saved.state, 1)
        saved.step(skipped=False)
        newest = checkpoints.save(saved.state, 2)
        assert newest is not None
        data = bytearray(store.get(newest.name))
        data[len(data) // 2] ^= 0xFF
        store.put(newest.name, bytes(data))
        loaded = Run(seed=1)
        with caplog.at_level(logging.WARNING):
            entry = checkpoints.load(loaded.state)
        assert entry is not None and entry.step == 1 and loaded.trainer.step == 1
        assert not loaded.optimizer.state
        assert f"file {newest.name} of the checkpoint of step 2" in caplog.text


def test_a_state_loaded_from_a_save_without_optimizer_state_saves_its_later_one(
    tmp_path: Path,
) -> None:
    # The same state objects serve a load and the saves after it: what the load expected of
    # its checkpoint must not decide what a later save holds.
    with one_process_world():
        checkpoints = ShardedCheckpoints(FileStore(tmp_path / "store"), tmp_path / "scratch")
        saved = Run(seed=0)
        saved.step(skipped=True)
        checkpoints.save(saved.state, 1)
        loaded = Run(seed=1)
        assert checkpoints.load(loaded.state) is not None
        loaded.step(skipped=False)
        assert loaded.optimizer.state
        checkpoints.save(loaded.state, 2)
        names = _names(checkpoints, tmp_path / "scratch")
        assert f"model.{HYPERPARAMETERS}" not in names
        assert any(n.startswith("model.optimizer.state.") for n in names), sorted(names)
