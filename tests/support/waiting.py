"""The tests' one way to wait: poll a condition until it holds, and fail with what was awaited.

Tests wait on events (a file written, a line logged, a process gone), never on a bare sleep;
the timeout is only the bound past which the event is taken as never coming.
"""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.02


def wait_until(
    condition: Callable[[], object],
    timeout_s: float,
    what: str = "the condition",
    *,
    detail: Callable[[], str] | None = None,
) -> float:
    """Poll ``condition`` until it is truthy; return the seconds it took.

    Raises AssertionError naming ``what`` (and ``detail()``, say a log's tail) when
    ``timeout_s`` passes first.
    """
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            extra = f":\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{extra}")
        time.sleep(POLL_S)
    return time.monotonic() - started


def holds_within(condition: Callable[[], object], timeout_s: float) -> bool:
    """Whether ``condition`` became truthy within ``timeout_s`` (for a test that asserts on it)."""
    try:
        wait_until(condition, timeout_s)
    except AssertionError:
        return False
    return True
