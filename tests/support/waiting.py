"""The tests' one way to wait: poll a condition until it holds, and fail with what was awaited.

Tests wait on events (a file written, a line logged, a process gone), never on a bare sleep;
the timeout is only the bound past which the event is taken as never coming.

Ranks a test spawns wait on each other in three places, each bounded by ``gloo_group``: the
store (60 s), every collective (the group's timeout), and anything else, such as a C++ call
that honours neither, by a watchdog that prints every thread's stack and ends the rank.
``mp.spawn`` then reports which rank stopped where; the test's own timeout would only show the
parent waiting.
"""

from __future__ import annotations

import faulthandler
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

POLL_S = 0.02
STORE_TIMEOUT_S = 60.0
STUCK_S = 150.0
"""A rank alive this long in one group is stuck: the slowest body takes under a minute on a
loaded two-core machine; each test's own timeout is longer."""


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


def init_gloo(
    init_file: Path | str, rank: int, world: int, timeout_s: float = 60.0, stuck_s: float = STUCK_S
) -> None:
    """Join the default gloo group of ``world`` ranks that meet at ``init_file``; every
    collective times out after ``timeout_s``, and the rank ends after ``stuck_s``."""
    import torch.distributed as dist  # here: most tests that wait import no torch

    faulthandler.dump_traceback_later(stuck_s, exit=True)
    store = dist.FileStore(str(init_file), world)
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


@contextmanager
def gloo_group(
    init_file: Path | str, rank: int, world: int, timeout_s: float = 60.0, stuck_s: float = STUCK_S
) -> Iterator[None]:
    """``init_gloo`` for the body, left together once every rank's body returned.

    A rank whose body raised leaves the group as it is: destroying a group while a peer still
    waits in a collective can hang both (pytorch/pytorch#75097, and torchtitan stopped doing
    it after an exception, pytorch/torchtitan#1342); the error is what the test must show.
    The barrier has its own timeout: a body may end later on one rank than the group's short
    collective timeout (a slow final save).
    """
    import torch.distributed as dist

    init_gloo(init_file, rank, world, timeout_s, stuck_s)
    yield
    dist.monitored_barrier(timeout=timedelta(seconds=STORE_TIMEOUT_S))
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
