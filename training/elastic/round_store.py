"""The workers' store of one round: a c10d TCPStore in rank 0's agent, as torch's c10d handler
shares its own (torch 2.13, ``dynamic_rendezvous.py``: ``_create_tcp_store_server`` and
``use_agent_store``).

With ``use_agent_store`` true, torch's agent tells its workers ``TORCHELASTIC_USE_AGENT_STORE``,
and each worker's ``init_process_group`` connects to MASTER_ADDR:MASTER_PORT as a client,
with no key prefix: "We create a new TCPStore for every retry" (``torch/distributed/
rendezvous.py``, ``_create_c10d_store``). So every round gets a new server. It listens on the
socket whose port rank 0's join key published (``master_listen_fd``): held from the join on,
the port is never free for another process to take, and a peer that connects before the
server is up waits in the socket's backlog instead of being refused.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket  # noqa: TC003 - a parameter's type
import threading

from torch.distributed import PrefixStore, Store, TCPStore

logger = logging.getLogger(__name__)

AGENT_PREFIX = "spot-lab/agent"
"""The agents' own keys (torch's exit barrier), apart from the workers' unprefixed ones."""


class StoreUnreachable(RuntimeError):
    """Rank 0's store did not answer in time: rank 0 went away after its round completed."""


class RoundStore:
    """This agent's handle on the current round's store: the server, or a client."""

    def __init__(self) -> None:
        self._server: TCPStore | None = None
        self._client: TCPStore | None = None

    def host(self, held: socket.socket, addr: str, timeout_s: float) -> Store:
        """Serve the round's store on ``held`` (rank 0); the agents' view of it."""
        self.close()
        port = held.getsockname()[1]
        # The server owns the descriptor it is given and closes it when it goes (measured,
        # torch 2.13), which may be after this agent dropped its own handles: a copy of it.
        listen_fd = os.dup(held.fileno())
        held.close()
        self._server = TCPStore(
            host_name=addr,
            port=port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=listen_fd,
        )
        return PrefixStore(AGENT_PREFIX, self._server)

    def connect(self, addr: str, port: int, timeout_s: float) -> Store:
        """A client of rank 0's store; StoreUnreachable when it does not answer in time.

        The client is made on a thread of its own, waited for ``timeout_s``: TCPStore's
        client bounds a refused connection by its timeout, but once the kernel accepted the
        connection (a frozen rank 0, or a held socket whose server never came) it waits for
        the server's answer with no bound (measured, torch 2.13). The thread is left to the
        connection's fate then; this node goes on to the next round.
        """
        self.close()
        made: list[TCPStore] = []
        failed: list[str] = []

        def make() -> None:
            try:
                made.append(
                    TCPStore(
                        host_name=addr,
                        port=port,
                        is_master=False,
                        timeout=datetime.timedelta(seconds=timeout_s),
                    )
                )
            except RuntimeError as exc:  # torch's DistNetworkError and DistStoreError
                text = str(exc).strip()
                failed.append(text.splitlines()[0] if text else repr(exc))

        thread = threading.Thread(target=make, name="rdzv-store-client", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not made:
            why = failed[0] if failed else f"no answer in {timeout_s:.0f} s"
            raise StoreUnreachable(f"rank 0's store at {addr}:{port}: {why}")
        self._client = made[0]
        return PrefixStore(AGENT_PREFIX, self._client)

    def close(self) -> None:
        """Drop this handle on the server or the client: the server stops, and its port
        refuses, once torch's agent dropped its own (the next round's store replaces it)."""
        self._server = self._client = None
