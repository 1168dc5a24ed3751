"""A lab node: one ``torchrun`` agent (and its workers), like one pod on one Spot VM.

The runner talks to nodes through the small ``NodeProcess`` protocol so tests can put
fakes in. ``TorchrunNode`` is the real thing: its own session, its own log files, its
own node-local dir, and every signal goes to the whole process tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from lab.local import process_tree
from training.elastic.launch import ElasticPolicy, worker_env


class NodeProcess(Protocol):
    """What the runner needs from a node."""

    name: str
    stdout_path: Path
    """JSON lines from the training program."""
    stderr_path: Path
    """Human logs: the agent's and the workers'."""

    def start(self) -> None:
        """Start (or restart in place) the node's agent."""

    def poll(self) -> int | None:
        """The agent's exit code, or None while it runs."""

    def kill(self) -> None:
        """Hard node loss: SIGKILL the whole process tree."""

    def notify_eviction(self) -> None:
        """The Spot notice: SIGTERM to the agent, which drains its workers."""

    def freeze(self) -> None:
        """A VM that vanished: SIGSTOP the whole tree, sockets stay open."""

    def thaw(self) -> None:
        """The paused VM comes back: SIGCONT the whole tree."""

    def terminate(self, grace_s: float) -> None:
        """Stop for good: SIGTERM, then SIGKILL the tree after ``grace_s``. Idempotent."""


@dataclass(frozen=True)
class NodeLaunch:
    """Everything that defines how one node runs: the same as a PyTorchJob worker pod."""

    name: str
    command: list[str]
    env: dict[str, str]
    cwd: Path
    log_dir: Path
    local_dir: Path
    tmp_dir: Path
    """The node's TMPDIR: the pod's own /tmp, removed with the lab's workspace."""


def node_env(
    policy: ElasticPolicy,
    checkpoint_uri: str,
    local_dir: Path,
    collective_timeout_s: int,
    tmp_dir: Path,
    launcher: str = "warm",
) -> dict[str, str]:
    """The pod's env: the operator's PET_* plus the worker env, from the same source."""
    return {
        **policy.pet_env(),
        **worker_env(
            checkpoint_uri=checkpoint_uri,
            local_dir=str(local_dir),
            collective_timeout_s=collective_timeout_s,
            launcher=launcher,
        ),
        # Lab only: several nodes share a few cores; one thread each avoids thrashing.
        "OMP_NUM_THREADS": "1",
        # Lab only: every agent makes a torchelastic_* dir under TMPDIR and never removes it.
        # A pod's /tmp goes with the pod; here it goes with the lab's workspace.
        "TMPDIR": str(tmp_dir),
        # Lab only: torchrun's agents log each rendezvous round (its group_world_size) at
        # INFO, so every node's log shows the rounds its report entries can be checked against.
        "LOGLEVEL": "INFO",
    }


@dataclass
class TorchrunNode:
    """A real node: ``torchrun`` in its own session, logs in ``log_dir/<name>.{jsonl,log}``."""

    launch: NodeLaunch
    starts: int = 0
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _files: list[IO[bytes]] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return self.launch.name

    @property
    def stdout_path(self) -> Path:
        return self.launch.log_dir / f"{self.name}.jsonl"

    @property
    def stderr_path(self) -> Path:
        return self.launch.log_dir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        """The agent's pid, once started."""
        return self._process.pid if self._process else None

    def start(self) -> None:
        self._close_files()
        self.launch.local_dir.mkdir(parents=True, exist_ok=True)
        # Python's tempfile quietly falls back to /tmp when TMPDIR does not exist.
        self.launch.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.launch.log_dir.mkdir(parents=True, exist_ok=True)
        # Append: a restart in place continues the same pod's log.
        out, err = open(self.stdout_path, "ab"), open(self.stderr_path, "ab")  # noqa: SIM115
        self._files = [out, err]
        self._process = subprocess.Popen(
            process_tree.dying_with_this_process(self.launch.command),
            env={**os.environ, **self.launch.env},
            cwd=self.launch.cwd,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            # torchrun is the pod's PID 1 stand-in: Ctrl-C in the lab's terminal must not reach it.
            start_new_session=True,
        )
        self.starts += 1

    def poll(self) -> int | None:
        if self._process is None:
            return None
        return self._process.poll()

    def kill(self) -> None:
        # Once reaped, the pid may belong to someone else: never signal it again.
        if self._process is not None and self._process.poll() is None:
            agent = self._process.pid
            killed = process_tree.kill_tree(agent)
            self._process.wait()
            # The workers re-parent to the lab (the subreaper) when the agent dies.
            process_tree.reap([p for p in killed if p != agent])

    def notify_eviction(self) -> None:
        if self._process is not None and self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGTERM)

    def freeze(self) -> None:
        if self._process is not None and self._process.poll() is None:
            process_tree.freeze_tree(self._process.pid)

    def thaw(self) -> None:
        if self._process is not None and self._process.poll() is None:
            process_tree.thaw_tree(self._process.pid)

    def terminate(self, grace_s: float) -> None:
        stop_nodes([self], grace_s)

    def wait_stopped(self) -> None:
        """Reap the agent (after ``stop_nodes`` signalled it) and close the log files."""
        if self._process is not None:
            if self._process.poll() is None:
                self.kill()  # not stopped after all: never leave a tree behind
            self._process.wait()
        self._close_files()

    def _close_files(self) -> None:
        for handle in self._files:
            handle.close()
        self._files = []


def stop_nodes(nodes: list[TorchrunNode], grace_s: float) -> None:
    """Stop every node for good, all at once: SIGTERM each running agent, one shared grace
    period, SIGKILL of every tree still there (a frozen one at once), then reap. Idempotent."""
    agents = [pid for n in nodes if (pid := n.pid) is not None and n.poll() is None]
    killed = process_tree.terminate_trees(agents, grace_s)
    for node in nodes:
        node.wait_stopped()
    process_tree.reap([p for p in killed if p not in agents])


def logged_bytes(node: NodeProcess) -> int:
    """How much the node has logged so far, both files (a restart in place appends)."""
    return sum(p.stat().st_size for p in (node.stdout_path, node.stderr_path) if p.exists())


def wait_for_first_word(node: NodeProcess, logged_at_start: int, timeout_s: float) -> None:
    """Until the node logs its first line since its start (``logged_at_start``), exits, or
    ``timeout_s`` passes. Its first line comes once Python and torch are loaded."""
    deadline = time.monotonic() + timeout_s
    while logged_bytes(node) <= logged_at_start and node.poll() is None:
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def wait_for_exit(node: NodeProcess, timeout_s: float) -> int | None:
    """Poll until the node's agent exits or ``timeout_s`` passes; the exit code or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = node.poll()
        if code is not None:
            return code
        time.sleep(0.05)
    return node.poll()
