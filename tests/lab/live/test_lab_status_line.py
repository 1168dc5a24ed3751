"""The live status line on a terminal: rewritten in place and never wider than the terminal,
or a narrow terminal wraps it and each "\\r" rewrite leaves a broken line behind."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import termios
from collections.abc import Iterator

import pytest

from lab.live.job_view import JobView
from lab.live.status_line import StatusLine, status_text


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    """A pseudo-terminal: (the lab's end, the reader's end)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    reader, lab_end = pty.openpty()
    try:
        yield lab_end, reader
    finally:
        os.close(reader)
        os.close(lab_end)


def _resize(fd: int, columns: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))


def _written(reader: int) -> str:
    """Everything written so far (flushed before: it is in the terminal's buffer already)."""
    chunks = []
    while select.select([reader], [], [], 0.05)[0]:
        chunks.append(os.read(reader, 65536))
    return b"".join(chunks).decode()


def _long_status() -> str:
    view = JobView(step=120, world_size=3, loss=1.93, last_event="resumed step 120 on node-1")
    return status_text(42.0, view, 400, "waiting for world size 3 after fault 5 (join a new node)")


def test_every_rewrite_fits_the_terminal_even_after_it_narrows(terminal: tuple[int, int]) -> None:
    lab_end, reader = terminal
    text = _long_status()
    assert len(text) > 100
    status = StatusLine(os.fdopen(os.dup(lab_end), "w"))
    assert status.is_tty
    for columns in (60, 30):
        _resize(lab_end, columns)
        status.update(text)
        status.update(text)
        rewrites = _written(reader).split("\r")[1:]
        assert rewrites and all(0 < len(line) < columns for line in rewrites), rewrites
        assert rewrites[-1] == text[: columns - 1]


def test_a_wide_terminal_shows_the_whole_line(terminal: tuple[int, int]) -> None:
    lab_end, reader = terminal
    _resize(lab_end, 200)
    status = StatusLine(os.fdopen(os.dup(lab_end), "w"))
    status.update(_long_status())
    assert _written(reader) == "\r" + _long_status()


def test_columns_from_the_environment_win(
    terminal: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    lab_end, reader = terminal
    _resize(lab_end, 200)
    monkeypatch.setenv("COLUMNS", "41")
    status = StatusLine(os.fdopen(os.dup(lab_end), "w"))
    status.update(_long_status())
    assert _written(reader) == "\r" + _long_status()[:40]
