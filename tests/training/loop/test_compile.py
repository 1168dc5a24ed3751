"""``--compile``: charlm compiled (inductor, on the CPU) trains through a fault in the middle of
gradient accumulation and loses no step; the resumed run ends where an uninterrupted compiled
run ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.exactness import (
    TOLERANCE,
    flags,
    make_data,
    matches,
    raising_in_micro_batch,
    reference,
    run_here,
)
from tests.support.peer_failures import gloo_peer_closed
from training.loop.trainer_state import EXIT_OK, EXIT_RESTART
from training.tasks import TASKS

pytestmark = pytest.mark.timeout(900)


@pytest.mark.usefixtures("processes", "training")  # inductor runs the C++ compiler
def test_compiled_charlm_loses_no_step_to_a_fault(tmp_path: Path) -> None:
    data = make_data("charlm", tmp_path / "data")
    args = flags("charlm", "--compile=true", "--dropout=0.1", "--max-steps=8")
    expected = reference(tmp_path / "reference", data, args)
    faulty = raising_in_micro_batch(TASKS["charlm"], step=5, micro_batch=1, error=gloo_peer_closed)
    first, code = run_here(tmp_path / "run", data, args, spec=faulty)
    assert code == EXIT_RESTART
    assert getattr(first.trainer.model, "_compiled_call_impl", None) is not None  # compiled
    (save,) = first.events("emergency_save")
    assert (save["step"], save["reason"]) == (5, "peer_failure")
    second, code = run_here(tmp_path / "run", data, args)
    assert code == EXIT_OK
    (resumed,) = second.events("resumed")
    assert (resumed["source"], resumed["step"], resumed["lost_steps"]) == ("local", 5, 0)
    assert matches(tmp_path / "run", expected) < TOLERANCE
