"""Every thread that saves sets the process's CUDA device before it touches CUDA (CPU tests:
torch.cuda's device calls recorded, this process on "GPU 1"). A new thread's device is 0
whatever its starter set: on local rank 1 a save thread that set nothing would make its
streams and copies on GPU 0."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tests.support.trainer_harness import harness, make_data_dir, one_process_world
from training.checkpoints import devices
from training.checkpoints.deadline import Deadline, within
from training.elastic.exit_codes import WORKER_RESTART
from training.loop import trainer_state
from training.loop.saves.periodic import BackgroundSaver

LOCAL_RANK = 1


def _record_devices(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """(thread name, what): each ``set_device`` call and each step of the work, in order; the
    test's own thread is on device ``LOCAL_RANK``, every other thread on 0 until it sets one."""
    recorded: list[tuple[str, object]] = []
    current: dict[str, int] = {threading.current_thread().name: LOCAL_RANK}

    def set_device(device: object) -> None:
        index = device.index if isinstance(device, torch.device) else device
        current[threading.current_thread().name] = int(index)  # type: ignore[arg-type]
        recorded.append((threading.current_thread().name, f"set_device {index}"))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(
        torch.cuda, "current_device", lambda: current.get(threading.current_thread().name, 0)
    )
    return recorded


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    return _record_devices(monkeypatch)


def _work(calls: list[tuple[str, object]]) -> str:
    name = threading.current_thread().name
    calls.append((name, f"work on {torch.cuda.current_device()}"))
    return name


def test_the_deadlines_thread_works_on_its_callers_device(calls: list) -> None:
    name = within(Deadline.after(30), lambda: _work(calls), "a part")
    assert name != threading.current_thread().name
    assert calls == [(name, f"set_device {LOCAL_RANK}"), (name, f"work on {LOCAL_RANK}")]


def test_the_periodic_savers_thread_works_on_the_loops_device(calls: list) -> None:
    saver = BackgroundSaver(lambda step, state: _work(calls) and None, lambda e, s: None)
    assert saver.submit(4, {}) and saver.wait(30)
    assert calls == [
        ("checkpoint", f"set_device {LOCAL_RANK}"),
        ("checkpoint", f"work on {LOCAL_RANK}"),
    ]


def test_a_process_off_cuda_sets_no_device(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    devices.use_device(torch.device("cpu"))
    devices.use_device(None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no GPU used yet
    within(Deadline.after(30), lambda: _work(calls), "a part")
    assert [what for _, what in calls] == ["work on 0"]


def test_the_sigterm_thread_sets_the_device_before_its_save(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    data = make_data_dir(tmp_path_factory)
    with one_process_world():
        h = harness(tmp_path_factory.mktemp("run"), data, "--max-steps=1")
        h.trainer.restore()
        calls = _record_devices(monkeypatch)  # after the build, which runs on the CPU
        monkeypatch.setattr(trainer_state, "exit_now", lambda code: calls.append(("exit", code)))
        h.trainer.device = torch.device("cuda", LOCAL_RANK)  # what the save reads: recorded
        monkeypatch.setattr(
            h.trainer, "emergency_save", lambda reason, stop: calls.append(("save", reason))
        )
        stop = SimpleNamespace(requested=True, at=None)
        thread = threading.Thread(target=h.trainer.stop_now, args=(stop,), name="sigterm")
        thread.start()
        thread.join(30)
    assert calls == [
        ("sigterm", f"set_device {LOCAL_RANK}"),
        ("save", "sigterm"),
        ("exit", WORKER_RESTART),
    ]
