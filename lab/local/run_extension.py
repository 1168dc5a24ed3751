"""When the lab moves a run's end: every scheduled fault is injected and recovers before it.

On a loaded machine a fault can take longer to settle than the schedule gives it; the next
fault then fires late (as soon as the previous one settled), and the training would still
stop at ``max_steps`` before the faults still to come. So while a fault is still to be
injected or to settle, the lab keeps the end a margin ahead of the step the job is at. The
training reads the new end from ``--max-steps-file`` every step.

The margin is what the job can run while the lab does not look: ``MARGIN_S`` at the job's
recent pace (an etcd restart blocks the lab's loop for its down time and its start, 5 s on a
loaded machine), and never under ``MIN_MARGIN_STEPS``. It also makes the ranks agree: each
reads the new end long before it could stop at the old one. On a machine that keeps up with
the schedule the end never moves.
"""

from __future__ import annotations

import math
import os
from collections import deque
from pathlib import Path

MARGIN_S = 15.0
"""Seconds of training the end stays ahead: three times the longest the lab's loop blocks."""
MIN_MARGIN_STEPS = 50
RATE_WINDOW_S = 10.0
"""The job's pace is measured over this much of the recent past."""


class StepRate:
    """Steps per second over the last ``RATE_WINDOW_S``, from (time, step) observations."""

    def __init__(self) -> None:
        self._seen: deque[tuple[float, int]] = deque()

    def observe(self, now: float, step: int) -> float:
        """Record the job at ``step`` at ``now``; the pace since the window's start. A step
        that went back (a resume from an older checkpoint) counts as no progress."""
        self._seen.append((now, step))
        while len(self._seen) > 2 and now - self._seen[1][0] >= RATE_WINDOW_S:
            self._seen.popleft()
        then, first = self._seen[0]
        return max(step - first, 0) / (now - then) if now > then else 0.0


def margin_steps(steps_per_s: float) -> int:
    """The steps the end stays ahead of the job at this pace."""
    return max(MIN_MARGIN_STEPS, math.ceil(steps_per_s * MARGIN_S))


def extended_end(current_end: int, step: int, faults_remain: bool, margin: int) -> int | None:
    """The run's new end, seen at ``step``, or None when it stays: it moves only while a
    fault is still to be injected or to settle, and only once the job came within ``margin``
    of it; then two margins ahead, so that it moves once per margin of steps, not per poll."""
    if not faults_remain or step + margin <= current_end:
        return None
    return step + 2 * margin


def write_max_steps(path: Path, steps: int) -> None:
    """The training's ``--max-steps-file``, replaced whole: a rank never reads half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(str(steps))
    os.replace(partial, path)
