"""A hard deadline: what an eviction's save must fit into (the pod's termination grace).

A Python thread blocked in a socket read or a write to a stuck disk cannot be interrupted, so a
hard deadline runs the work on a thread of its own and stops waiting for it when time is up
(``within``). The caller then gives up cleanly; the thread is abandoned, and the process,
which is about to exit anyway, ends it. Inside the work, ``Deadline.remaining`` bounds each
store call, so the work also gives up by itself rather than wait out an SDK default.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from training.checkpoints.devices import carried

T = TypeVar("T")
logger = logging.getLogger(__name__)

NOT_TRANSIENT: tuple[type[OSError], ...] = (PermissionError, NotADirectoryError, IsADirectoryError)
"""Store errors no retry fixes (denied, a path through a file)."""


class DeadlineExceeded(TimeoutError):
    """The work did not finish before its deadline (it may still finish in the background)."""


@dataclass(frozen=True)
class Deadline:
    """A point on ``clock`` (monotonic by default) by which something must be done."""

    at: float
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(clock() + seconds, clock)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(self.at - self.clock(), 0.0)

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def check(self, what: str) -> None:
        """Raise DeadlineExceeded naming ``what`` when no time is left for it."""
        if self.expired:
            raise DeadlineExceeded(f"no time left for {what}")


def within(deadline: Deadline, work: Callable[[], T], what: str) -> T:
    """``work()``'s result, or DeadlineExceeded once ``deadline`` passed while it still ran.

    The work runs on a daemon thread; its exception, if it ends with one, is re-raised here.
    """
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as exc:  # handed to the caller, which decides
            outcome["error"] = exc

    # On the caller's GPU: a copy the work makes runs on a stream of that device.
    thread = threading.Thread(target=carried(run), name=f"deadline:{what}", daemon=True)
    thread.start()
    thread.join(deadline.remaining())
    if thread.is_alive():
        raise DeadlineExceeded(f"{what} did not finish by its deadline")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]


def retrying(deadline: Deadline, work: Callable[[], T], what: str, pause_s: float = 0.1) -> T:
    """``work()``, tried again after a store error a retry may fix (a timeout, a refused
    connection, a 5xx) while ``deadline`` leaves time for it: a store that fails for a moment
    must not cost an eviction its durable commit. The pause doubles up to 1 s; the last error
    is raised when no time is left, or at once for DeadlineExceeded and ``NOT_TRANSIENT``.
    """
    while True:
        try:
            return work()
        except (DeadlineExceeded, *NOT_TRANSIENT):
            raise
        except OSError as exc:
            if deadline.remaining() <= pause_s:
                raise
            logger.warning("%s failed (%s); trying again in %.1f s", what, exc, pause_s)
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 1.0)


def persisting(deadline: Deadline | None, work: Callable[[], T], what: str) -> T:
    """``work()`` as an eviction's save runs it: inline when nothing bounds it; else on a
    thread given up at ``deadline``, tried again after the store errors a retry may fix."""
    if deadline is None:
        return work()
    return within(deadline, lambda: retrying(deadline, work, what), what)


def why_not(exc: BaseException) -> str:
    """What a save that failed with ``exc`` records: ``deadline``, or the error's start."""
    return "deadline" if isinstance(exc, DeadlineExceeded) else str(exc)[:200]
