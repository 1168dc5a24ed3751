"""The test tiers: markers that follow from the fixtures a test uses, and a guard that keeps the
fast tier honest; and the groups that keep tests on one worker when ``make test`` runs them on
several (pytest-xdist, ``--dist loadgroup``).

A test that uses a fixture of ``FIXTURE_MARKERS`` gets that fixture's marker and ``slow``;
``make test-fast`` runs ``-m "not slow"``. A test without ``processes`` may start no process:
the guard makes every way Python starts one (subprocess, fork, spawn) fail the test with the
fixture to declare, so a test cannot slip a real process into the fast tier unmarked.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling

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

HEAVY = "heavy"
"""The declaring fixture (tests/conftest.py) of a test that loads the whole machine for a minute
or more: such tests share one worker, so no two of them run at once."""

WIDER_SCOPES = ("module", "class", "package")


def mark_by_fixtures(item: pytest.Item) -> None:
    """Add to ``item`` the markers of the declaring fixtures it uses, and ``slow`` with any."""
    names = getattr(item, "fixturenames", ())
    markers = {FIXTURE_MARKERS[name] for name in names if name in FIXTURE_MARKERS}
    for marker in sorted(markers):
        item.add_marker(marker)
    if markers and item.get_closest_marker(SLOW) is None:
        item.add_marker(SLOW)


def worker_group(item: pytest.Item) -> str | None:
    """The worker group of ``item`` (xdist runs a group's tests on one worker, in turn):
    ``heavy`` for a test that uses that declaration, else its module's path when it uses a
    module's fixture (split over two workers, each would pay for the same setup: a reference
    training run, a lab run, a Pulumi preview), else none."""
    names = getattr(item, "fixturenames", ())
    if HEAVY in names:
        return HEAVY
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    definitions = fixtureinfo.name2fixturedefs.values() if fixtureinfo else ()
    if any(defs[-1].scope in WIDER_SCOPES for defs in definitions if defs):
        return item.nodeid.split("::", 1)[0]
    return None


class WorkerGroups(LoadGroupScheduling):
    """``--dist loadgroup`` with the groups of ``worker_group``. xdist 3.8 marks a group by
    setting ``item._nodeid``, which pytest 9 no longer reads (a node's id is ``_id``), so its
    groups never reach the scheduler; here each worker writes its collection's groups to
    ``GROUPS_DIR`` before it reports the collection, and the scheduler reads them from there."""

    def __init__(self, config: pytest.Config, log: Any, groups_dir: Path) -> None:
        super().__init__(config, log)
        self._groups_dir = groups_dir
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:  # every worker has reported its collection by now
            self._groups = {}
            for written in sorted(self._groups_dir.glob("*.json")):
                self._groups |= json.loads(written.read_text())
        return self._groups.get(nodeid, nodeid)


GROUPS_DIR = "worker_groups_dir"
"""The key of the workers' input that names where they write their groups."""


def write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker of ``WorkerGroups``: the group of every test of ``items`` that has one."""
    workerinput = getattr(config, "workerinput", {})
    if GROUPS_DIR not in workerinput:
        return
    groups = {item.nodeid: group for item in items if (group := worker_group(item)) is not None}
    target = Path(workerinput[GROUPS_DIR]) / f"{workerinput['workerid']}.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(groups))
    partial.rename(target)  # the scheduler never reads half a file


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
