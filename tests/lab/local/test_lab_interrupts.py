"""The lab's signal handling: the first signal interrupts, later ones wait for the cleanup."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from lab.local.interrupts import interrupt_guard


@pytest.fixture(autouse=True)
def _restore_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    # A shell's background job starts with SIGINT ignored, and the guard leaves an ignored
    # signal alone: these tests start from Python's own handlers, as an interactive run does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_the_first_signal_interrupts_and_later_ones_are_only_recorded() -> None:
    cleaned_up = []
    with interrupt_guard() as guard:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        # The cleanup: a second Ctrl-C in the middle of it must not cut it short.
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        cleaned_up.append(True)
    assert cleaned_up == [True]
    assert guard.received == [signal.SIGTERM, signal.SIGINT, signal.SIGINT]
    assert guard.exit_code == 143


def test_once_deferred_even_the_first_signal_waits() -> None:
    with interrupt_guard() as guard:
        guard.defer()
        signal.raise_signal(signal.SIGINT)
    assert guard.exit_code == 130


def test_a_nested_guard_is_the_outer_one_and_redelivers_nothing() -> None:
    with interrupt_guard(take_ignored=True) as outer:
        with interrupt_guard(redeliver=True) as inner:
            assert inner is outer
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGHUP)
        assert outer.received == [signal.SIGHUP]  # not raised a second time
        assert outer.exit_code == 129


def test_handlers_are_restored_and_the_signal_redelivered_after_the_block() -> None:
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    with interrupt_guard(redeliver=True) as guard:
        guard.defer()
        signal.raise_signal(signal.SIGTERM)
        assert seen == []  # held back while the session cleans up
    assert seen == [signal.SIGTERM]


def test_an_ignored_signal_stays_ignored_unless_taken() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with interrupt_guard() as guard:
        signal.raise_signal(signal.SIGHUP)
    assert guard.received == []
    with interrupt_guard(take_ignored=True) as guard, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGHUP)
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
