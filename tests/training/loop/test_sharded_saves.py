"""A sharded run's saves in one process (a world of one, FSDP2 on gloo): what an emergency at
step 0 leaves, and what a save between steps holds.

torch's ``get_state_dict`` fills an optimizer that has no state yet by calling ``step()`` with
zero gradients and a zero learning rate (torch 2.13 ``checkpoint/state_dict.py``,
``_init_optim_state``): AdamW's step count becomes 1 with zero moments, though no step was
trained. Saved and restored, that count changes the bias correction of every later step.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support.exactness import CORPUS_SAMPLE
from tests.support.trainer_harness import harness, one_process_world
from tests.support.waiting import wait_until
from training.checkpoints.checkpoint import CheckpointError
from training.checkpoints.storage import FileStore
from training.loop.saves import sharded as saves_sharded

FLAGS = [
    "--task=charlm",
    "--parallelism=fsdp2",
    "--block-size=16",
    "--n-layer=1",
    "--n-embd=16",
    "--n-head=2",
    "--global-batch-size=4",
    "--micro-batch-size=4",
]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "input.txt").write_text(CORPUS_SAMPLE.read_text()[:4000])
    return root


def test_an_emergency_at_step_0_leaves_no_optimizer_step_to_restore(
    tmp_path: Path, corpus: Path
) -> None:
    with one_process_world():
        first = harness(tmp_path, corpus, *FLAGS, tiny=())
        first.trainer.restore()
        first.trainer.emergency_save("peer_failure")
        assert not first.trainer.optimizer.state  # nothing trained, nothing made up
        again = harness(tmp_path, corpus, *FLAGS, tiny=())
        resume = again.trainer.restore()
        assert resume.step == 0
        steps = [int(s["step"]) for s in again.trainer.optimizer.state.values() if "step" in s]
        assert steps == [], steps  # a fresh AdamW: its first step is step 1


class _Unreadable(FileStore):
    def list(self, prefix: str = "") -> list[str]:
        raise OSError("list: the store went away")


def test_a_coordinator_that_cannot_read_the_store_fails_the_restore_on_every_rank(
    tmp_path: Path, corpus: Path
) -> None:
    """The coordinator reads the store alone and broadcasts what it read: its storage error
    is broadcast too, as a CheckpointError every rank raises (a restart), rather than one
    rank raising while the others wait out the group's timeout in the broadcast."""
    with one_process_world():
        h = harness(tmp_path, corpus, *FLAGS, tiny=())
        h.trainer.sharded.checkpoints.store = _Unreadable(tmp_path / "durable")
        h.trainer.sharded.checkpoints.repository.store = h.trainer.sharded.checkpoints.store
        with pytest.raises(CheckpointError, match="the coordinator cannot read"):
            h.trainer.restore()


def test_the_loop_and_the_sigterm_thread_save_one_part_the_second_waiting_for_the_first(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both may call it at once (a peer lost on the loop, the eviction's SIGTERM on its thread).
    # Two writers of one part under one name left a file whose bytes were not the ones its
    # record hashed (a CI run: the eviction resumed two steps back, from a periodic save).
    with one_process_world():
        run = harness(tmp_path, corpus, *FLAGS, tiny=())
        trainer = run.trainer
        trainer.restore()
        trainer.state.step = 1  # as after a step whose gradients fp16's scaler skipped
        sharded = trainer.sharded
        calls: list[int] = []
        release, second_asked = threading.Event(), threading.Event()
        real = saves_sharded.save_part

        def slow_save_part(*args: Any, **kwargs: Any) -> None:
            calls.append(1)
            if len(calls) == 1:
                release.wait(60)
            real(*args, **kwargs)

        monkeypatch.setattr(saves_sharded, "save_part", slow_save_part)
        outcomes: list[Any] = []
        first = threading.Thread(
            target=lambda: outcomes.append(sharded.emergency_save("peer_failure", lambda: False))
        )
        first.start()
        wait_until(lambda: calls, 60, "the first save to start")

        def asked() -> bool:
            second_asked.set()
            return False

        second = threading.Thread(
            target=lambda: outcomes.append(sharded.emergency_save("sigterm", asked))
        )
        second.start()
        wait_until(
            lambda: len(calls) > 1 or (second_asked.is_set() and sharded._emergency_lock.locked()),
            60,
            "the second save to start or to wait",
        )
        release.set()
        first.join(60)
        second.join(60)
        assert len(calls) == 1
        assert len(outcomes) == 2 and outcomes[0] == outcomes[1] and outcomes[0].durable
