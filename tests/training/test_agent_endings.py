"""Whatever lands when, a node's exit code is the truth the operator acts on: a SIGTERM after
the agent's work is done is recorded, not raised, and nothing unexpected exits 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import SignalException

from tests.support.waiting import wait_until
from training import agent
from training.elastic.exit_codes import OK, RETRY_ME

REPO = Path(__file__).resolve().parents[2]

# The node as the operator runs it (``python -m training.agent``), its agent's work stubbed:
# it ends as ``{ending}``, and a real SIGTERM lands while it settles the rendezvous (etcd
# writes with 2 s timeouts, in the cluster).
SIGTERM_IN_SETTLE = """
import os, signal, sys
from training import agent, launcher

class Settling:
    def withdraw(self):
        print("withdrew", flush=True)

    def settle(self, close, why):
        os.kill(os.getpid(), signal.SIGTERM)
        print("settled", close, why, flush=True)

def launch_warm(args, handlers):
    handlers.append(Settling())  # the handler launch made
    if {evicted}:  # the SIGTERM came before the ending (torch's agent raises it after a stop)
        launcher.STOP.hold()
        os.kill(os.getpid(), signal.SIGTERM)
    return {ending}

launcher.STOP.install()
agent._launch_warm = launch_warm
agent._commit_node_save = lambda args: print("committed", launcher.STOP.at is not None, flush=True)
sys.exit(agent.main([], env={{}}))
"""


@pytest.mark.parametrize(
    ("ending", "evicted", "code", "printed"),
    [
        # The sequence: the peers evicted, this node's restarts spent, its own
        # eviction's SIGTERM inside settle. The node's save is still made durable.
        ((RETRY_ME, False), False, RETRY_ME, ["settled False failed", "committed True"]),
        # finished: the run is over, nothing to commit
        ((OK, True), False, OK, ["settled True finished"]),
        # Evicted before: the save is durable before the node leaves the round (chaos seed 23:
        # it left first, and the next round restored a state 26 steps older meanwhile); its
        # join is withdrawn first, so no open round makes it a member meanwhile.
        ((143, False), True, 143, ["withdrew", "committed True", "settled False failed"]),
    ],
    ids=["restarts-spent", "finished", "evicted"],
)
@pytest.mark.usefixtures("processes")
def test_a_sigterm_while_the_agent_settles_is_recorded_not_raised(
    ending: tuple[int, bool], evicted: bool, code: int, printed: list[str]
) -> None:
    script = SIGTERM_IN_SETTLE.format(ending=ending, evicted=evicted)
    # Started with SIGTERM blocked, as from this process after a test that made a worker's
    # StopRequest (its sigwait thread needs it blocked): the agent must unblock it.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert result.returncode == code, result.stderr[-2000:]
    assert result.stdout.split("\n")[:-1] == printed, result.stdout


@pytest.mark.parametrize(
    ("raised", "code"),
    [
        (SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM), 143),
        (SignalException("Process 1 got signal: 2", sigval=signal.SIGINT), 130),
        (RuntimeError("an agent's bug"), RETRY_ME),
        (AttributeError("'NoneType' object has no attribute 'is_failed'"), RETRY_ME),
    ],
    ids=["sigterm", "sigint", "runtime-error", "attribute-error"],
)
def test_whatever_leaves_the_agent_never_exits_1(
    monkeypatch: pytest.MonkeyPatch, raised: BaseException, code: int
) -> None:
    def run_warm(args: list[str], handlers: list) -> int:
        raise raised

    monkeypatch.setattr(agent, "run_warm", run_warm)
    monkeypatch.setattr(agent, "_leave_rendezvous", lambda handlers: None)
    assert agent.main([], env={}) == code


def test_the_stop_is_held_once_the_agents_work_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    # A SIGTERM landing in an ending's except body (its logging) must not replace the ending.
    from training import launcher

    stop = launcher.AgentStop()
    monkeypatch.setattr(launcher, "STOP", stop)

    def launch(args: list[str], handlers: list | None = None) -> None:
        raise ValueError("--lr must be > 0")

    monkeypatch.setattr(launcher, "launch", launch)
    previous = signal.signal(signal.SIGTERM, stop._handle)
    # Sent to this thread, with SIGTERM unblocked in it: os.kill would go to any thread, and a
    # worker's StopRequest made by an earlier test in this process leaves SIGTERM blocked here
    # and a sigwait thread that would take it (training/elastic/faults.py).
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        assert agent._launch_warm([]) == (2, False)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # recorded, not raised
        wait_until(lambda: stop.signum is not None, 10, "the handler to run")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGTERM, previous)
    assert stop.signum == signal.SIGTERM and stop.at is not None
