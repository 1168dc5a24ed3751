"""When the lab moves a run's end: every scheduled fault is injected and recovers before it.

On a loaded machine a fault can take longer to settle than the schedule gives it; the next
fault then fires late (as soon as the previous one settled), and the training would still
stop at ``max_steps`` before the faults still to come. So while a fault is still to be
injected or to settle, the lab keeps the end at least ``EXTENSION_MARGIN_STEPS`` ahead of the
step the job is at. The training reads the new end from ``--max-steps-file`` every step; the
margin makes every rank read it long before it could stop at the old end. On a machine that
keeps up with the schedule the end never moves.
"""

from __future__ import annotations

import os
from pathlib import Path

EXTENSION_MARGIN_STEPS = 50
"""Steps between the job and its end while faults remain: 5 s at the CI scenario's pace, far
more than the lab's lag behind the logs (a poll, a log line)."""


def extended_end(current_end: int, step: int, faults_remain: bool) -> int | None:
    """The run's new end, seen at ``step``, or None when it stays: it moves only while a
    fault is still to be injected or to settle, and only once the job came within the margin
    of it; then two margins ahead, so that it moves every margin's worth of steps, not at
    every poll."""
    if not faults_remain or step + EXTENSION_MARGIN_STEPS <= current_end:
        return None
    return step + 2 * EXTENSION_MARGIN_STEPS


def write_max_steps(path: Path, steps: int) -> None:
    """The training's ``--max-steps-file``, replaced whole: a rank never reads half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(str(steps))
    os.replace(partial, path)
