"""Is a node's agent alive? A probe that answers for the process, not for its scheduler.

Each agent listens on a TCP port of its own and answers every connection with its node id. A
peer's verdict then comes from the kernel as much as from the agent:
- refused (RST): nothing listens there any more, the agent process is gone (a kill, a crash,
  an agent that left): **dead**, at once, with no heartbeat to wait out;
- an answer with the node's id: **alive**, however busy: a starved or slow agent answers
  within the scheduler's latency, not within a heartbeat period;
- no answer in time (a VM that vanished sends no RST; a frozen process accepts but never
  answers): **unknown**. The rendezvous takes that for dead only once the node's heartbeat
  key has expired as well (training/rendezvous.py), so a slow node needs both a missed TTL
  and a missed probe to be taken for dead.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import socket
import threading

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5
"""How long a probe waits for a connection and an answer. A live agent answers in
milliseconds, even with every core busy (measured: bench/rendezvous_scale.py, the starvation
test); the probe decides only for a node whose heartbeat already expired."""


class Verdict(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


class ProbeServer:
    """Answers every connection with this node's id, from a thread of its own."""

    def __init__(self, node_id: str, host: str = "") -> None:
        self.node_id = node_id
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rdzv-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        answer = self.node_id.encode() + b"\n"
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn, contextlib.suppress(OSError):
                conn.sendall(answer)

    def close(self) -> None:
        """Stop answering: from now on a probe is refused, which peers read as 'left'."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def probe(addr: str, port: int, node_id: str, timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """The verdict on ``node_id`` listening at ``addr:port``."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = conn.recv(256)
                if not chunk:
                    break
                answer += chunk
    except ConnectionRefusedError:
        return Verdict.DEAD
    except TimeoutError:
        return Verdict.UNKNOWN
    except OSError as exc:  # unreachable host or network: no proof either way
        logger.debug("probe of %s at %s:%d: %s", node_id, addr, port, exc)
        return Verdict.UNKNOWN
    if not answer:  # accepted and closed without a word: the listener is going away
        return Verdict.DEAD
    # Another process on the same address and port (a reused IP or port) is not this node.
    return Verdict.ALIVE if answer.strip().decode(errors="replace") == node_id else Verdict.DEAD
