"""Both tasks through the one API: in float64 on the CPU, a run interrupted and resumed ends
where an uninterrupted one ends, and loses no completed step.

Each case is its own test, for each task: a kill of every rank restored from the durable
store at another world size; a resume exactly at an epoch boundary; a fault in the middle of
a gradient-accumulation cycle; dropout on; the LR scheduler stopped mid-warmup. The runs are
real Trainers on gloo groups, in this process (world size 1) or spawned (2 or 3 ranks). A
lost, repeated or half-applied step, a sample drawn twice or a mask drawn again shows as a
difference many orders of magnitude above the tolerance (tests/support/exactness.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.exactness import (
    STEPS_PER_EPOCH,
    TOLERANCE,
    events,
    flags,
    make_data,
    matches,
    raising_in_micro_batch,
    reference,
    run_here,
    run_spawned,
)
from tests.support.peer_failures import gloo_peer_closed
from tests.support.trainer_harness import (
    Harness,
    durable_head,
    saved_checkpoint,
    sigterm_during,
    under,
)
from training.elastic.exit_codes import OK, WORKER_RESTART
from training.records import EMERGENCY_SAVE, METRICS, RESUMED
from training.tasks import TASKS

pytestmark = pytest.mark.timeout(300)
TASK_NAMES = sorted(TASKS)
MAX_STEPS = 10


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, training: None) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {task: make_data(task, root / task) for task in TASK_NAMES}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("references")


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("task", TASK_NAMES)
def test_killed_everywhere_then_restored_from_the_durable_store_at_another_world_size(
    task: str, data: dict[str, Path], references: Path, tmp_path: Path
) -> None:
    args = flags(task, f"--max-steps={MAX_STEPS}", "--checkpoint-every-steps=2")
    expected = reference(references / f"{task}-plain", data[task], args)
    first = run_spawned(tmp_path, data[task], 2, args, kill_at=5)
    assert first == {}  # both ranks exited at step 5's boundary, without a word
    head = durable_head(tmp_path / "durable")
    assert head is not None and head.step == 4
    second = run_spawned(tmp_path, data[task], 3, args)
    assert {rank: code for rank, (code, _) in second.items()} == {0: OK, 1: OK, 2: 0}
    (resumed,) = events(second[0][1], RESUMED)
    assert (resumed["source"], resumed["step"], resumed["world_size"]) == ("durable", 4, 3)
    assert matches(tmp_path, expected) < TOLERANCE


@pytest.mark.parametrize("task", TASK_NAMES)
def test_a_resume_exactly_at_an_epoch_boundary_matches_uninterrupted(
    task: str, data: dict[str, Path], references: Path, tmp_path: Path
) -> None:
    args = flags(task, f"--max-steps={MAX_STEPS}")
    expected = reference(references / f"{task}-plain", data[task], args)
    _, code = run_here(tmp_path, data[task], flags(task, f"--max-steps={STEPS_PER_EPOCH}"))
    assert code == OK
    second, code = run_here(tmp_path, data[task], args)
    assert code == OK
    (resumed,) = second.events(RESUMED)
    assert (resumed["source"], resumed["step"]) == ("durable", STEPS_PER_EPOCH)
    epochs = {r["step"]: r["epoch"] for r in _metrics(second)}
    assert min(epochs) == STEPS_PER_EPOCH + 1 and epochs[STEPS_PER_EPOCH + 1] == 1
    assert matches(tmp_path, expected) < TOLERANCE


@pytest.mark.parametrize("task", TASK_NAMES)
def test_a_fault_in_the_middle_of_gradient_accumulation_loses_no_step(
    task: str, data: dict[str, Path], references: Path, tmp_path: Path
) -> None:
    args = flags(task, f"--max-steps={MAX_STEPS}")
    expected = reference(references / f"{task}-plain", data[task], args)
    # 12 samples in micro-batches of 4: the peer is lost in the second of step 6's three,
    # after one micro-batch's gradients were accumulated.
    faulty = raising_in_micro_batch(TASKS[task], step=5, micro_batch=1, error=gloo_peer_closed)
    first, code = run_here(tmp_path, data[task], args, spec=faulty)
    assert code == WORKER_RESTART
    (save,) = first.events(EMERGENCY_SAVE)
    assert (save["step"], save["reason"]) == (5, "peer_failure")
    second, code = run_here(tmp_path, data[task], args)
    assert code == OK
    (resumed,) = second.events(RESUMED)
    assert (resumed["source"], resumed["step"], resumed["lost_steps"]) == ("local", 5, 0)
    assert matches(tmp_path, expected) < TOLERANCE


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("task", TASK_NAMES)
def test_with_dropout_on_a_resume_at_another_world_size_matches_uninterrupted(
    task: str, data: dict[str, Path], references: Path, tmp_path: Path
) -> None:
    args = flags(task, "--dropout=0.5", f"--max-steps={MAX_STEPS}")
    expected = reference(references / f"{task}-dropout", data[task], args)
    without = reference(references / f"{task}-plain", data[task], flags(task, "--dropout=0"))
    assert max(float((expected[k] - without[k]).abs().max()) for k in expected) > 1e-4
    _, code = run_here(tmp_path, data[task], flags(task, "--dropout=0.5", "--max-steps=6"))
    assert code == OK
    second = run_spawned(tmp_path, data[task], 2, args)
    (resumed,) = events(second[0][1], RESUMED)
    assert (resumed["step"], resumed["world_size"]) == (6, 2)
    assert matches(tmp_path, expected) < TOLERANCE


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("task", TASK_NAMES)
def test_the_lr_scheduler_stopped_mid_warmup_resumes_where_it_was(
    task: str, data: dict[str, Path], references: Path, tmp_path: Path
) -> None:
    args = flags(task, "--warmup-steps=8", f"--max-steps={MAX_STEPS}")
    expected = reference(references / f"{task}-warmup", data[task], args)

    def sigterm_in_step_4(h: Harness, stop: SimpleNamespace) -> None:
        sigterm_during(h, 4, stop)  # the loop finishes step 4, saves it, and exits

    _, code = run_here(tmp_path, data[task], args, before=sigterm_in_step_4)
    assert code == WORKER_RESTART
    saved = saved_checkpoint(tmp_path / "durable")
    assert saved["step"] == 4 and saved["trainer.scheduler.last_epoch"] == 4
    groups = under(saved, "model.optimizer.param_groups.")
    lrs = [lr for name, lr in groups.items() if name.endswith(".lr")]
    base = saved["trainer.scheduler.base_lrs"][0]
    assert lrs and all(lr == pytest.approx(base * 5 / 8) for lr in lrs)
    second = run_spawned(tmp_path, data[task], 2, args)
    (resumed,) = events(second[0][1], RESUMED)
    assert (resumed["source"], resumed["step"], resumed["world_size"]) == ("durable", 4, 2)
    assert matches(tmp_path, expected) < TOLERANCE


def _metrics(h: Harness) -> list[dict]:
    import json

    return [
        r
        for r in map(json.loads, h.stream.getvalue().splitlines())
        if r["kind"] == METRICS and "loss" in r
    ]
