"""The hard deadline of an eviction's save: the caller stops waiting; the work is left behind."""

from __future__ import annotations

import threading

import pytest

from training.checkpoints.deadline import Deadline, DeadlineExceeded, within


def test_within_returns_the_result_or_the_error_of_the_work() -> None:
    later = Deadline.after(60)
    assert within(later, lambda: 7, "sum") == 7
    with pytest.raises(KeyError, match="boom"):
        within(later, lambda: {}["boom"], "lookup")


def test_within_gives_up_at_the_deadline_while_the_work_still_runs() -> None:
    release = threading.Event()
    passed = Deadline(at=10.0, clock=lambda: 11.0)  # no time left
    with pytest.raises(DeadlineExceeded, match="upload did not finish by its deadline"):
        within(passed, lambda: release.wait(30), "upload")
    release.set()


def test_a_deadline_counts_down_on_its_clock() -> None:
    now = [0.0]
    deadline = Deadline.after(25.0, clock=lambda: now[0])
    now[0] = 24.0
    assert deadline.remaining() == 1.0 and not deadline.expired
    now[0] = 26.0
    assert deadline.remaining() == 0.0 and deadline.expired
    with pytest.raises(DeadlineExceeded, match="no time left for the manifest"):
        deadline.check("the manifest")
    assert isinstance(DeadlineExceeded(), TimeoutError)  # callers handle it as a store timeout
