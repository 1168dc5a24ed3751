"""The live status line on stderr: rewritten in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from typing import TextIO

from lab.live.job_view import JobView


def status_text(elapsed_s: float, view: JobView, max_steps: int, note: str = "") -> str:
    """``[  42.0s] world 3 | step 120/300 | loss 1.9321 | resumed step 120 ...``."""
    loss = "-" if view.loss is None else f"{view.loss:.4f}"
    text = (
        f"[{elapsed_s:7.1f}s] world {view.world_size} | step {view.step}/{max_steps} | "
        f"loss {loss} | {view.last_event}"
    )
    return f"{text} | {note}" if note else text


def terminal_columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to, asked at every call (it may have been
    resized): ``COLUMNS`` when set, else the terminal itself, else what ``shutil`` finds."""
    if (columns := os.environ.get("COLUMNS", "")).isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(stream.fileno()).columns or shutil.get_terminal_size().columns
    except (AttributeError, OSError, ValueError):  # no file descriptor, or not a terminal
        return shutil.get_terminal_size().columns


class StatusLine:
    """Writes status updates: ``\\r``-rewritten on a TTY, every ``interval_s`` otherwise."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.is_tty = self.stream.isatty()
        self.interval_s = interval_s
        self._last_plain = -math.inf  # the first update always prints
        self._width = 0

    def update(self, text: str, now: float | None = None) -> None:
        """Show ``text``; on a non-TTY only if ``interval_s`` passed since the last line."""
        now = time.monotonic() if now is None else now
        if self.is_tty:
            # Never wider than the terminal: a line that wraps is no longer rewritten by
            # "\r" but stacked, one broken line per update. The last column stays free, as
            # some terminals wrap once it is written.
            fits = max(terminal_columns(self.stream) - 1, 1)
            text = text[:fits]
            padded = text.ljust(min(self._width, fits))
            self._width = len(text)
            self.stream.write("\r" + padded)
        elif now - self._last_plain >= self.interval_s:
            self._last_plain = now
            self.stream.write(text + "\n")
        else:
            return
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line that stays (a fault injected, a node restarted)."""
        if self.is_tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line so the next output starts on a fresh line."""
        if self.is_tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
