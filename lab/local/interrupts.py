"""Signals during a lab session: the first one interrupts, later ones wait for the cleanup.

The first SIGINT, SIGTERM or SIGHUP raises KeyboardInterrupt, so the code in flight unwinds
through its ``finally`` blocks and context managers: nodes stopped, etcd stopped, the
workspace removed. A second Ctrl-C while that cleanup runs must not cut it short (it would
leave nodes running and remove the temp dir under them), so every later signal is only
recorded.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from training.elastic.exit_codes import signal_exit

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class InterruptGuard:
    """Records the signals it handles; only the first one raises KeyboardInterrupt, and
    none does once ``defer()`` was called."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.deferred = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler."""
        self.received.append(signum)
        if len(self.received) == 1 and not self.deferred:
            raise KeyboardInterrupt(f"signal {signum}")

    def defer(self) -> None:
        """From now on only record: the cleanup has begun and must run to its end."""
        self.deferred = True

    @property
    def exit_code(self) -> int:
        """128 + the first signal (143 for SIGTERM, 130 for SIGINT); 130 if none came."""
        first = self.received[0] if self.received else signal.SIGINT
        return signal_exit(first)


def _active_guard() -> InterruptGuard | None:
    for sig in HANDLED_SIGNALS:
        handler: Any = signal.getsignal(sig)
        owner = getattr(handler, "__self__", None)
        if isinstance(owner, InterruptGuard):
            return owner
    return None


@contextmanager
def interrupt_guard(
    *, take_ignored: bool = False, redeliver: bool = False
) -> Iterator[InterruptGuard]:
    """Handle HANDLED_SIGNALS with an InterruptGuard while the block runs; restore after.

    Re-entrant: inside an active guard (the command line's) it yields that one and leaves
    it alone. Signals a caller ignores stay ignored unless ``take_ignored`` (a shell that
    starts the lab in the background ignores SIGINT for it). With ``redeliver``, the first
    signal received is raised again once the block ended normally, for the handler that was
    there before: a library caller's own handler (or the default action) decides what it
    means, after the session cleaned up. Outside the main thread no handler can be set.
    """
    active = _active_guard()
    if active is not None:
        yield active
        return
    guard = InterruptGuard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    previous = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    for sig, handler in previous.items():
        if take_ignored or handler is not signal.SIG_IGN:
            signal.signal(sig, guard.handle)
    try:
        yield guard
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if redeliver and guard.received:  # not reached when the block raised
        signal.raise_signal(guard.received[0])
