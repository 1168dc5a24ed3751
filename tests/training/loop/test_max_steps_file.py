"""``--max-steps-file``: the local lab raises a run's end while it trains, so faults that fell
behind the schedule still fire before the end. A real Trainer on a gloo group of one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.support.trainer_harness import harness
from training.elastic.exit_codes import OK
from training.loop.metrics import Phases
from training.records import FINISHED


def _finished_at(h) -> int:
    (finished,) = h.events(FINISHED)
    return finished["step"]


def test_a_count_written_while_training_runs_raises_the_end(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    limit = tmp_path / "max-steps"
    h = harness(tmp_path, data_dir, "--max-steps=3", f"--max-steps-file={limit}")
    real_step = h.trainer.train_step

    def train_step() -> tuple[float, int]:
        if h.trainer.state.step == 1:
            limit.write_text("6")  # the lab extends the run at step 1, well before step 3
        return real_step()

    h.trainer.train_step = train_step  # type: ignore[method-assign]
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    assert _finished_at(h) == 6


def test_a_missing_unreadable_or_lower_count_leaves_the_flags_end(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    for text in (None, "not a number", "2"):
        root = tmp_path / str(text)
        root.mkdir()
        limit = root / "max-steps"
        if text is not None:
            limit.write_text(text)
        h = harness(root, data_dir, "--max-steps=4", f"--max-steps-file={limit}")
        assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
        assert _finished_at(h) == 4, text
