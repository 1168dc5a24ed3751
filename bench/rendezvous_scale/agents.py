"""The agents: the training's rendezvous handler, many to a spawned worker process.

A 2-core machine cannot run 64 agent processes, so a few spawned worker processes host the
agents in threads, each with its own etcd clients and probe port. The coordinator sends each
worker ``(command, args)`` and reads ``(ok|error, value)`` back; the agents put what they
did (joined a round, failed) on one queue, stamped with the monotonic clock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from training.elastic.exit_codes import VERDICT_ENV
from training.elastic.launch import ROUND_FILE_ENV

MONITOR_S = 0.1
"""torch's agent asks ``num_nodes_waiting`` this often (its monitor loop)."""


class ScaleError(RuntimeError):
    """A worker process failed or did not answer."""


class _Host:
    """The agents of one worker process, and the commands the coordinator sends it."""

    def __init__(self, port: int, events: Any) -> None:
        self.port, self.events = port, events
        self.handlers: dict[int, Any] = {}
        self.gone: set[int] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def make(self, run_id: str, indices: list[int], max_nodes: int, conf: dict[str, str]) -> int:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from training.elastic.rendezvous import BACKEND, create_handler

        self.handlers, self.gone = {}, set()
        for index in indices:
            params = RendezvousParameters(
                BACKEND, f"127.0.0.1:{self.port}", run_id, 1, max_nodes, "127.0.0.1", **conf
            )
            self.handlers[index] = create_handler(params)  # the training's own path
        return len(indices)

    def _live(self) -> list[tuple[int, Any]]:
        return [(i, h) for i, h in self.handlers.items() if i not in self.gone]

    def join(self, phase: int, start: float) -> int:
        self._stop = threading.Event()
        for index, handler in self._live():
            args = (phase, index, handler, start, self._stop)
            thread = threading.Thread(target=self._drive, args=args, daemon=True)
            thread.start()
            self._threads.append(thread)
        return len(self._live())

    def _drive(self, phase: int, index: int, handler: Any, start: float, stop: Any) -> None:
        """One agent as torch's runs it: join, then poll num_nodes_waiting; >0: join again."""
        time.sleep(max(0.0, start - time.monotonic()))
        while not stop.is_set():
            try:
                info = handler.next_rendezvous()
            except Exception as exc:  # noqa: BLE001 - reported, the phase fails
                self.events.put((phase, index, "error", repr(exc), time.monotonic()))
                return
            joined = (handler.round, info.rank, info.world_size)
            self.events.put((phase, index, "joined", joined, time.monotonic()))
            while not stop.wait(MONITOR_S):
                if handler.num_nodes_waiting() > 0:
                    break

    def stop(self) -> int:
        """End the agents' loops; how many are still inside next_rendezvous."""
        self._stop.set()
        deadline = time.monotonic() + 2.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        return len(self._threads)

    def quiet(self, until: float, every_s: float) -> dict[int, int]:
        """Poll every live agent's num_nodes_waiting until ``until``; >0 polls per agent."""
        positives = {index: 0 for index, _ in self._live()}
        while (now := time.monotonic()) < until:
            for index, handler in self._live():
                positives[index] += handler.num_nodes_waiting() > 0
            time.sleep(max(0.0, now + every_s - time.monotonic()))
        return positives

    def kill(self, index: int) -> float:
        """What SIGKILL leaves: no more heartbeats, a refused port, a key until its TTL (its
        keys' stop and probe, as tests/training/elastic/test_rendezvous.py kills one)."""
        at = time.monotonic()
        handler = self.handlers[index]
        handler.keys.stop.set()
        handler.keys.probe.close()
        self.gone.add(index)
        return at

    def leave(self, index: int) -> float:
        at = time.monotonic()
        self.handlers[index].leave()
        self.gone.add(index)
        return at

    def close(self) -> int:
        self.stop()
        for _, handler in self._live():
            handler.leave()
        return len(self._live())


def _worker_main(conn: Connection, events: Any, port: int, log_path: str) -> None:
    """A spawned worker: hosts agents, answers ``(command, args)`` with ``(ok|error, value)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops us
    for var in (VERDICT_ENV, ROUND_FILE_ENV):
        os.environ.pop(var, None)
    logging.basicConfig(
        filename=log_path, level=logging.INFO, format=f"%(asctime)s {os.getpid()} %(message)s"
    )
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    import training.elastic.rendezvous  # noqa: F401 - torch, once, before "ready"

    host = _Host(port, events)
    conn.send(("ok", os.getpid()))
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):
            return  # the coordinator is gone
        if command == "exit":
            return
        try:
            conn.send(("ok", getattr(host, command)(*args)))
        except Exception as exc:  # noqa: BLE001 - the coordinator decides
            conn.send(("error", f"{command}: {exc!r}"))


class Fleet:
    """The worker processes for N agents: agent ``i`` lives in process ``i // per_process``."""

    def __init__(self, nodes: int, per_process: int, port: int, log_path: Path) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        self.nodes, self.per_process = nodes, per_process
        self.events: Any = ctx.Queue()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self._phases = itertools.count(1)
        for _ in range(math.ceil(nodes / per_process)):
            parent, child = ctx.Pipe()
            args = (child, self.events, port, str(log_path))
            proc = ctx.Process(target=_worker_main, args=args, daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_ready(self) -> None:
        for conn in self.conns:
            self._reply(conn, 180)  # torch's import, on a busy machine

    def indices(self, worker: int) -> list[int]:
        start = worker * self.per_process
        return list(range(start, min(start + self.per_process, self.nodes)))

    def _reply(self, conn: Connection, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise ScaleError(f"a worker process did not answer within {timeout_s:g} s")
        status, value = conn.recv()
        if status != "ok":
            raise ScaleError(f"worker process: {value}")
        return value

    def call(self, command: str, *args: Any, timeout_s: float = 30) -> list[Any]:
        """Every worker runs ``command`` (at the same time); their answers."""
        for conn in self.conns:
            conn.send((command, args))
        return [self._reply(conn, timeout_s) for conn in self.conns]

    def call_on(self, index: int, command: str, *args: Any) -> Any:
        """The worker hosting agent ``index`` runs ``command``."""
        conn = self.conns[index // self.per_process]
        conn.send((command, args))
        return self._reply(conn, 30)

    def make(self, run_id: str, conf: dict[str, str]) -> None:
        for worker, conn in enumerate(self.conns):
            conn.send(("make", (run_id, self.indices(worker), self.nodes, conf)))
        for conn in self.conns:
            self._reply(conn, 30)

    def next_phase(self) -> int:
        return next(self._phases)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("exit", ()))
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@contextlib.contextmanager
def fleet_of(nodes: int, per_process: int, port: int, log_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(nodes, per_process, port, log_path)
    try:
        fleet.wait_ready()
        yield fleet
    finally:
        fleet.close()
