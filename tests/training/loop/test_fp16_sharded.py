"""fp16-mixed under ``--parallelism fsdp2``: a checkpoint inside the steps the gradient scaler
skips, and one after them.

The scaler starts at 2**16 and halves on each overflow; charlm's first steps overflow, so the
optimizer takes its first step at step 6 here (``SKIPPED``) while steps 1-5 are counted: the
data consumed, the scheduler's position and the scaler's backoff are state, but the optimizer
has none. torch's ``get_state_dict`` would make a step-1 AdamW state up for it
(``_init_optim_state``), so such a checkpoint holds the optimizer's hyperparameters only and
its restore leaves the optimizer fresh. Every save kind, each resumed at its step, ends on
exactly the parameters of an uninterrupted run at the same world size (world 1: the same
computation in the same order). A window save at world 2 resumes at world 1: resharded.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.exactness import flags, make_data, run_here, run_spawned
from tests.support.trainer_harness import Harness, sigterm_during
from training.checkpoints.node_local import NONE
from training.checkpoints.sharded.parts import complete
from training.checkpoints.sharded.reader import StoreReader
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import HYPERPARAMETERS
from training.checkpoints.storage import FileStore
from training.elastic.exit_codes import OK, WORKER_RESTART
from training.records import EMERGENCY_SAVE, RESUMED

pytestmark = pytest.mark.timeout(300)
MAX_STEPS = 8
SKIPPED = 5
"""The steps whose gradients overflow at the scaler's start (the scale halves 5 times)."""
ARGS = [
    *flags("charlm", "--dropout=0.1", f"--max-steps={MAX_STEPS}", "--parallelism=fsdp2"),
    "--dtype=float32",
    "--precision=fp16-mixed",
]


class Crash(RuntimeError):
    """The process dies between steps: no emergency save (the loop re-raises it)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, training: None) -> Path:
    return make_data("charlm", tmp_path_factory.mktemp("data"))


def _whole(root: Path) -> tuple[int, dict[str, torch.Tensor]]:
    read = ShardedCheckpoints(FileStore(root / "durable"), root / "scratch").read_whole(
        "model.model."
    )
    assert read is not None, f"no sharded checkpoint in {root}"
    return read[0].step, read[1]


def _newest_names(root: Path) -> frozenset[str]:
    """The DCP names of the newest checkpoint, once the parts are committed (as the next
    restore's coordinator commits them)."""
    checkpoints = ShardedCheckpoints(FileStore(root / "durable"), root / "scratch")
    head = checkpoints.repository.head()
    complete(checkpoints, head.step if head is not None else NONE)
    entry = checkpoints.entries()[0]
    metadata = StoreReader(checkpoints.store, entry, root / "scratch").read_metadata()
    return frozenset(metadata.state_dict_metadata)


@pytest.fixture(scope="module")
def uninterrupted(
    data: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, torch.Tensor], list[tuple[int, bool, float]]]:
    """The final parameters, and each step's (step, optimizer has state, scale)."""
    root, seen = tmp_path_factory.mktemp("whole"), []

    def watch(h: Harness, stop: SimpleNamespace) -> None:
        real = h.trainer.train_step

        def train_step() -> tuple[float, float]:
            result = real()
            scaler = h.trainer.precision.scaler
            assert scaler is not None
            seen.append((h.trainer.state.step, bool(h.trainer.optimizer.state), scaler.get_scale()))
            return result

        h.trainer.train_step = train_step  # type: ignore[method-assign]

    _, code = run_here(root, data, ARGS, before=watch)
    assert code == OK
    step, whole = _whole(root)
    assert step == MAX_STEPS
    return whole, seen


def test_the_scaler_skips_the_first_steps(uninterrupted: Any) -> None:
    """The premise of the window: steps 1-5 counted with no optimizer state, then trained."""
    _, seen = uninterrupted
    assert [s for s, has_state, _ in seen if not has_state] == list(range(1, SKIPPED + 1))
    assert seen[SKIPPED - 1][2] == 2.0**16 / 2**SKIPPED


def _restored(into: dict[str, Any]) -> Any:
    """A ``before`` hook noting what the restore left: the optimizer's and the scaler's state."""

    def before(h: Harness, stop: SimpleNamespace) -> None:
        real = h.trainer.restore

        def restore() -> Any:
            resume = real()
            opt = h.trainer.optimizer.state
            into["optimizer_steps"] = sorted({int(s["step"]) for s in opt.values()})
            into["scaler"] = h.trainer.precision.state_dict()
            return resume

        h.trainer.restore = restore  # type: ignore[method-assign]

    return before


def _crash_in(step: int) -> Any:
    """The process dies as step ``step`` (1-based) starts, once the saves in flight are done."""

    def before(h: Harness, stop: SimpleNamespace) -> None:
        real = h.trainer.train_step

        def train_step() -> tuple[float, float]:
            if h.trainer.state.step == step - 1:
                h.trainer.saver.wait(60)
                raise Crash(f"killed in step {step}")
            return real()

        h.trainer.train_step = train_step  # type: ignore[method-assign]

    return before


def _interrupt(kind: str, root: Path, data: Path) -> int:
    """The first segment; the step its checkpoint holds."""
    if kind == "parts":  # SIGTERM in step 4: each rank's part, no collective
        h, code = run_here(root, data, ARGS, before=lambda h, stop: sigterm_during(h, 4, stop))
        assert code == WORKER_RESTART
        (save,) = h.events(EMERGENCY_SAVE)
        assert save["durable"] and save["step"] == 4
        return 4
    if kind == "periodic":  # a collective save at step 3, then a crash in step 5
        with pytest.raises(Crash):
            run_here(root, data, [*ARGS, "--checkpoint-every-steps=3"], before=_crash_in(5))
        return 3
    if kind == "final":  # the run's end inside the window, then a longer run
        _, code = run_here(root, data, [*ARGS, "--max-steps=2"])
        assert code == OK
        return 2
    assert kind == "after"  # SIGTERM in step 7: the optimizer has taken 2 steps
    h, code = run_here(root, data, ARGS, before=lambda h, stop: sigterm_during(h, 7, stop))
    assert code == WORKER_RESTART
    return 7


@pytest.mark.parametrize("kind", ["parts", "periodic", "final", "after"])
def test_a_save_in_or_after_the_skipped_steps_resumes_at_its_step_and_repeats_the_run(
    kind: str, data: Path, tmp_path: Path, uninterrupted: Any
) -> None:
    expected, seen = uninterrupted
    saved_at = _interrupt(kind, tmp_path, data)
    names = _newest_names(tmp_path)
    in_window = saved_at <= SKIPPED
    # In the window: the hyperparameters in place of an optimizer state, and no state made up.
    assert (f"model.{HYPERPARAMETERS}" in names) == in_window, sorted(names)
    assert any(n.startswith("model.optimizer.state.") for n in names) == (not in_window)
    assert "trainer.extras.scaler.scale" in names
    restored: dict[str, Any] = {}
    second, code = run_here(tmp_path, data, ARGS, before=_restored(restored))
    assert code == OK
    (resumed,) = second.events(RESUMED)
    assert resumed["step"] == saved_at, resumed
    # A fresh AdamW in the window (its first step is step 1), its count after it.
    assert restored["optimizer_steps"] == ([] if in_window else [saved_at - SKIPPED])
    assert restored["scaler"]["scale"] == seen[saved_at - 1][2]  # the backoff resumed
    step, found = _whole(tmp_path)
    assert step == MAX_STEPS
    assert found.keys() == expected.keys()
    assert max(float((found[k] - expected[k]).abs().max()) for k in expected) == 0.0


@pytest.mark.usefixtures("processes")
def test_a_save_in_the_window_at_world_2_resumes_resharded_at_world_1(
    data: Path, tmp_path: Path, uninterrupted: Any
) -> None:
    expected, _ = uninterrupted
    # Every rank exits as step 4 starts, with no save: the periodic one of step 3 serves.
    run_spawned(tmp_path, data, 2, [*ARGS, "--checkpoint-every-steps=3"], kill_at=3)
    assert f"model.{HYPERPARAMETERS}" in _newest_names(tmp_path)
    second, code = run_here(tmp_path, data, ARGS)
    assert code == OK
    (resumed,) = second.events(RESUMED)
    assert (resumed["step"], resumed["world_size"]) == (3, 1), resumed
    _, found = _whole(tmp_path)
    # The same steps on another split of the batch: float32 sums in another order, ~1e-7
    # apart at most (measured here: 0.0); one step more or less moves them ~1e-3.
    error = max(float((found[k] - v).norm() / v.norm()) for k, v in expected.items())
    assert error <= 1e-6, error
