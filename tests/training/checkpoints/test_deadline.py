"""The hard deadline of an eviction's save: the caller stops waiting; the work is left behind."""

from __future__ import annotations

import threading
import time

import pytest

from training.checkpoints.deadline import (
    Deadline,
    DeadlineExceeded,
    persisting,
    retrying,
    why_not,
    within,
)


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


def _failing(errors: list[Exception]) -> tuple[list[int], object]:
    calls: list[int] = []

    def work() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "done"

    return calls, work


def test_retrying_outlasts_errors_a_retry_may_fix() -> None:
    calls, work = _failing([TimeoutError("slow"), ConnectionError("refused"), OSError("503")])
    assert retrying(Deadline.after(60), work, "a commit", pause_s=0.01) == "done"  # type: ignore[arg-type]
    assert len(calls) == 4


@pytest.mark.parametrize(
    "error",
    [PermissionError("denied"), NotADirectoryError("a file"), DeadlineExceeded("too late")],
)
def test_retrying_gives_up_at_once_on_what_no_retry_fixes(error: Exception) -> None:
    calls, work = _failing([error])
    with pytest.raises(type(error)):
        retrying(Deadline.after(60), work, "a commit", pause_s=0.01)  # type: ignore[arg-type]
    assert len(calls) == 1


def test_retrying_raises_the_last_error_when_no_time_is_left() -> None:
    calls, work = _failing([OSError("503")] * 3)
    with pytest.raises(OSError, match="503"):
        retrying(Deadline.after(0.0), work, "a commit")  # type: ignore[arg-type]
    assert len(calls) == 1


def test_persisting_runs_inline_without_a_deadline_and_retries_within_one() -> None:
    here = threading.current_thread()
    assert persisting(None, lambda: threading.current_thread(), "inline") is here
    tries: list[int] = []

    def flaky() -> int:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionResetError("the store hung up")
        return len(tries)

    assert persisting(Deadline(time.monotonic() + 30), flaky, "flaky") == 3


def test_why_not_names_the_deadline_or_the_errors_start() -> None:
    assert why_not(DeadlineExceeded("no time left")) == "deadline"
    assert why_not(OSError("x" * 300)) == "x" * 200
