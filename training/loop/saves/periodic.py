"""Periodic durable checkpoints: when to save (a small predicate) and a saver that writes in the
background while the loop goes on training.

A periodic save that fails does not stop training (the next one retries), but it is never
silent: every failure reaches ``on_failed`` with the count of failures in a row, so the trainer
can report it as an event and escalate when saves keep failing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.checkpoints.checkpoint import Entry, StaleCheckpoint
from training.checkpoints.devices import carried
from training.loop.metrics import EventLog

logger = logging.getLogger(__name__)

FAILURES_BEFORE_ERROR = 3
"""Periodic saves failed in a row before each further failure is logged as an error (with how
far the durable checkpoint lags): one failure is a blip a retry fixes, three are a store that
is down or refusing, which an eviction would turn into lost steps."""


@dataclass(frozen=True)
class SavePolicy:
    """When rank 0 writes a durable checkpoint."""

    every_steps: int = 100
    every_seconds: float = 0.0

    def should_save(self, step: int, last_step: int, last_time: float, now: float) -> bool:
        if step <= last_step:
            return False
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and now - last_time >= self.every_seconds


class BackgroundSaver:
    """Writes and commits snapshots on one background thread; the loop only copies.

    A save that comes due while the previous one is still being written is skipped, not
    queued: the next one supersedes it and the loop never waits on storage.
    """

    def __init__(
        self,
        write: Callable[[int, Any], Entry | None],
        on_saved: Callable[[Entry, float], None],
        on_failed: Callable[[int, BaseException, int], None] | None = None,
    ) -> None:
        """``write(step, snapshot)`` commits a snapshot: every rank writes its part, the
        coordinator commits and gets the entry (``on_saved`` runs where there is one).
        ``on_failed(step, error, failures_in_a_row)`` runs on the saver's thread."""
        self.write = write
        self.on_saved = on_saved
        self.on_failed = on_failed
        self._thread: threading.Thread | None = None
        self._step = -1
        self.error: BaseException | None = None
        """The last save's error; None once a save succeeds."""
        self.failures = 0
        """Saves failed in a row."""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_flight(self) -> int | None:
        """The step being written (until its callback returned), or None."""
        return self._step if self.busy else None

    def submit(self, step: int, state: dict[str, Any]) -> bool:
        """Start writing ``state`` (already a snapshot); False when a save is still running."""
        if self.busy:
            return False
        self._step = step
        # On this thread's GPU: DCP's copies and its staging streams are made on the saver's.
        write = carried(lambda: self._write(step, state))
        self._thread = threading.Thread(target=write, name="checkpoint", daemon=True)
        self._thread.start()
        return True

    def _write(self, step: int, state: dict[str, Any]) -> None:
        started = time.monotonic()
        try:
            entry = self.write(step, state)
        except StaleCheckpoint as exc:  # a newer step is committed: nothing is missing
            logger.info("periodic checkpoint of step %d not needed: %s", step, exc)
            return
        except Exception as exc:  # storage errors must not kill training; the next save retries
            self.error = exc
            self.failures += 1
            logger.warning("checkpoint at step %d failed: %s", step, exc)
            if self.on_failed is not None:
                self.on_failed(step, exc, self.failures)
            return
        self.error, self.failures = None, 0
        if entry is not None:
            self.on_saved(entry, time.monotonic() - started)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the save in flight (if any) is done, or ``timeout_s`` has passed.

        True when no save is running any more (committed or failed), False on timeout.
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.busy


def report_failure(
    events: EventLog, step: int, error: BaseException, in_a_row: int, durable: int, now: int
) -> None:
    """A failed periodic save as the report and the watch see it: a ``checkpoint_failed``
    event, and from ``FAILURES_BEFORE_ERROR`` failures in a row an error line each time, with
    how far the newest durable step (``durable``, -1 for none) lags the loop's (``now``)."""
    lag = now - durable if durable >= 0 else None
    events.event(
        "checkpoint_failed",
        step=step,
        error=str(error)[:200],
        failures_in_a_row=in_a_row,
        durable_step=durable,
        lag_steps=lag,
    )
    if in_a_row >= FAILURES_BEFORE_ERROR:
        logger.error(
            "%d periodic checkpoints in a row failed (last: %s); the newest durable one is step "
            "%d, %s steps behind: an eviction whose own save cannot reach the store would lose "
            "them",
            in_a_row,
            error,
            durable,
            lag if lag is not None else "all",
        )
