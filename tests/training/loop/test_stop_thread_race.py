"""The SIGTERM thread's save is the last state the process holds: once it has read step k, the
main thread applies no step k+1 (whose state would die with the process, a step lost).

Real Trainer on a gloo group of one. The stop thread runs ``Trainer.stop_now`` to its end (its
``exit_now`` recorded instead of ending the test process) while the main thread is between a
step's backward and its optimizer step: the moment a re-form's SIGTERM met under load.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.trainer_harness import harness
from training.loop import trainer_state
from training.loop.metrics import Phases


def test_no_step_is_applied_after_the_stop_threads_save(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(trainer_state, "exit_now", exits.append)
    h = harness(tmp_path, data_dir, "--checkpoint-every-steps=0", "--max-steps=8")
    stop = SimpleNamespace(requested=False, at=None)
    real_hold = h.trainer._hold_permit

    def hold_permit() -> None:
        # Step 4's gradients are reduced; before it is applied, the SIGTERM thread saves.
        if h.trainer.state.step == 3 and not exits:
            stop.requested = True
            thread = threading.Thread(target=h.trainer.stop_now, args=(stop,), name="sigterm")
            thread.start()
            thread.join()
        real_hold()

    h.trainer._hold_permit = hold_permit  # type: ignore[method-assign]
    h.trainer.run(stop, Phases())
    (save,) = [e for e in h.events("emergency_save") if e["reason"] == "sigterm"][:1]
    assert exits, "the stop thread ended"
    # Step 4 either goes into the save (applied first) or is never applied.
    assert save["step"] in (3, 4)
    assert h.trainer.state.step == save["step"], "a step was applied after the stop's save"
