"""Process-tree signals on real processes: a parent whose child runs in its own session.

That is the shape of a torchrun node: the agent starts each worker with
``start_new_session=True``, so signalling the agent's process group misses the worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.local import process_tree
from tests.support.waiting import wait_until

# A stand-in agent: starts one "worker" in a new session, writes its pid, then waits.
# On SIGTERM it forwards the signal to the worker and exits, as torchrun does.
AGENT = """
import signal, subprocess, sys, time
worker = subprocess.Popen(
    [sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"],
    start_new_session=True,
)
open(sys.argv[1], "w").write(str(worker.pid))
def forward(signum, frame):
    worker.terminate()
    worker.wait()
    sys.exit(0)
if sys.argv[2] == "forward":
    signal.signal(signal.SIGTERM, forward)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def agent_tree(
    tmp_path: Path, request: pytest.FixtureRequest, processes: None
) -> Iterator[tuple[subprocess.Popen, int]]:
    mode = getattr(request, "param", "forward")
    pid_file = tmp_path / "worker.pid"
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(pid_file), mode], start_new_session=True
    )
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", 10.0)
    worker = int(pid_file.read_text())
    yield agent, worker
    for pid in (worker, agent.pid):  # never leave a stray process behind a failed test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def test_descendants_cross_session_boundaries(agent_tree) -> None:
    agent, worker = agent_tree
    assert os.getsid(worker) != os.getsid(agent.pid)
    assert process_tree.descendants(agent.pid) == [worker]
    assert process_tree.tree(agent.pid) == [agent.pid, worker]


def test_killing_the_process_group_leaves_the_worker(agent_tree) -> None:
    """The trap a faithful node loss must avoid (and the reason kill_tree exists)."""
    agent, worker = agent_tree
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    assert process_tree.is_alive(worker)


def test_kill_tree_kills_agent_and_worker(agent_tree) -> None:
    agent, worker = agent_tree
    killed = process_tree.kill_tree(agent.pid)
    assert sorted(killed) == sorted([agent.pid, worker])
    assert agent.wait(timeout=5) == -signal.SIGKILL
    wait_until(lambda: not process_tree.is_alive(worker), 10.0)


def test_freeze_tree_stops_every_process(agent_tree) -> None:
    agent, worker = agent_tree
    process_tree.freeze_tree(agent.pid)
    wait_until(lambda: process_tree.is_stopped(agent.pid), 10.0)
    wait_until(lambda: process_tree.is_stopped(worker), 10.0)
    process_tree.kill_tree(agent.pid)  # a stopped process still dies of SIGKILL
    assert agent.wait(timeout=5) == -signal.SIGKILL
    wait_until(lambda: not process_tree.is_alive(worker), 10.0)


def test_thaw_tree_resumes_every_frozen_process(agent_tree) -> None:
    agent, worker = agent_tree
    process_tree.freeze_tree(agent.pid)
    wait_until(lambda: process_tree.is_stopped(worker), 10.0)
    assert sorted(process_tree.thaw_tree(agent.pid)) == sorted([agent.pid, worker])
    wait_until(lambda: not process_tree.is_stopped(agent.pid), 10.0)
    wait_until(lambda: not process_tree.is_stopped(worker), 10.0)
    assert agent.poll() is None and process_tree.is_alive(worker)  # back, not killed


def test_terminate_tree_lets_the_agent_drain(agent_tree) -> None:
    agent, worker = agent_tree
    leftovers = process_tree.terminate_tree(agent.pid, grace_s=10)
    assert leftovers == []
    assert agent.wait(timeout=5) == 0  # it exited on its own, after forwarding SIGTERM
    assert not process_tree.is_alive(worker)


@pytest.mark.parametrize("agent_tree", ["ignore"], indirect=True)
def test_terminate_tree_kills_what_ignores_sigterm(agent_tree) -> None:
    agent, worker = agent_tree
    leftovers = process_tree.terminate_tree(agent.pid, grace_s=0.5)
    assert sorted(leftovers) == sorted([agent.pid, worker])
    assert agent.wait(timeout=5) == -signal.SIGKILL
    wait_until(lambda: not process_tree.is_alive(worker), 10.0)


def test_signals_to_gone_processes_are_harmless(agent_tree) -> None:
    agent, _ = agent_tree
    process_tree.kill_tree(agent.pid)
    agent.wait()
    assert process_tree.kill_tree(agent.pid) == []
    assert process_tree.freeze_tree(agent.pid) == []


def test_reap_returns_only_once_the_process_is_dead(agent_tree) -> None:
    """SIGKILL is not instant on a loaded machine: reap waits, even for another's child."""
    _, worker = agent_tree
    killer = threading.Timer(0.5, os.kill, (worker, signal.SIGKILL))
    killer.start()
    try:
        process_tree.reap([worker], timeout_s=10)
        assert not process_tree.is_alive(worker)
    finally:
        killer.cancel()
