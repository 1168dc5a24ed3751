"""The test tiers: markers that follow from the fixtures a test uses, and a guard that keeps the
fast tier honest.

A test that uses a fixture of ``FIXTURE_MARKERS`` gets that fixture's marker and ``slow``;
``make test-fast`` runs ``-m "not slow"``. A test without ``processes`` may start no process:
the guard makes every way Python starts one (subprocess, fork, spawn) fail the test with the
fixture to declare, so a test cannot slip a real process into the fast tier unmarked.
"""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

SLOW = "slow"
PROCESSES = "processes"

FIXTURE_MARKERS: dict[str, str] = {
    "etcd": "etcd",
    "azurite": "azurite",
    "azurite_oauth": "azurite",
    "torchrun": "torchrun",
    PROCESSES: PROCESSES,
    "training": "training",
}
"""A fixture that starts something real, or trains, and the marker it gives the tests that use
it. The declarations (``processes``, ``torchrun``, ``etcd``, ``training``: tests/conftest.py)
are requested by a test or by the fixture that does the work, so every test that uses that
fixture is marked too; the services' declarations request ``processes``."""

MARKERS: dict[str, str] = {
    SLOW: "starts a real service or process, or trains for real; left out of make test-fast",
    "etcd": "uses a real etcd",
    "azurite": "uses the Azurite Blob emulator",
    "torchrun": "runs real torchrun agents and their workers",
    PROCESSES: "starts child processes (a CLI, a stand-in tool, spawned ranks)",
    "training": "trains a real model for many steps in this process",
}
"""Every marker the suite uses (pyproject.toml registers the same; --strict-markers)."""


def mark_by_fixtures(item: pytest.Item) -> None:
    """Add to ``item`` the markers of the declaring fixtures it uses, and ``slow`` with any."""
    names = getattr(item, "fixturenames", ())
    markers = {FIXTURE_MARKERS[name] for name in names if name in FIXTURE_MARKERS}
    for marker in sorted(markers):
        item.add_marker(marker)
    if markers and item.get_closest_marker(SLOW) is None:
        item.add_marker(SLOW)


class UndeclaredProcess(AssertionError):
    """A test that is not marked ``processes`` started a process."""


@contextmanager
def no_undeclared_process(item: pytest.Item) -> Iterator[None]:
    """While the block runs, starting a process fails ``item`` unless it is marked
    ``processes``."""
    if item.get_closest_marker(PROCESSES) is not None:
        yield
        return
    attempts: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            attempts.append(what)
            raise UndeclaredProcess(
                f"{item.nodeid} starts a process ({what}) but uses none of the fixtures that "
                f"declare one: {', '.join(sorted(FIXTURE_MARKERS))}. Request `processes` (or the "
                "fixture of the service it starts) so the test leaves make test-fast"
            )

        return refused

    patches = [
        (subprocess.Popen, "_execute_child", refuse("subprocess")),
        (os, "fork", refuse("os.fork")),
        (os, "forkpty", refuse("os.forkpty")),
        (os, "posix_spawn", refuse("os.posix_spawn")),
        (os, "posix_spawnp", refuse("os.posix_spawnp")),
        (multiprocessing.util, "spawnv_passfds", refuse("multiprocessing spawn")),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    # Code under test may have caught the error; the attempt still fails the test.
    if attempts:
        raise UndeclaredProcess(
            f"{item.nodeid} tried to start a process ({', '.join(attempts)}) without declaring "
            "it: request the `processes` fixture"
        )
