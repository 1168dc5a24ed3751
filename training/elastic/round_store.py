"""The workers' store of one round: a c10d TCPStore in rank 0's agent, as torch's c10d handler
shares its own (torch 2.13, ``dynamic_rendezvous.py``: ``_create_tcp_store_server`` and
``use_agent_store``).

With ``use_agent_store`` true, torch's agent tells its workers ``TORCHELASTIC_USE_AGENT_STORE``,
and each worker's ``init_process_group`` connects to MASTER_ADDR:MASTER_PORT as a client,
with no key prefix: "We create a new TCPStore for every retry" (``torch/distributed/
rendezvous.py``, ``_create_c10d_store``). So every round gets a new server. It listens on the
socket whose port rank 0's join key published (``master_listen_fd``): held from the join on,
the port is never free for another process to take, and a peer that connects before the
server is up waits in the socket's backlog instead of being refused. The agents' own store is
not this one (training/elastic/agent_store.py): an agent must not wait on a frozen rank 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket  # noqa: TC003 - a parameter's type

from torch.distributed import TCPStore

logger = logging.getLogger(__name__)


class RoundStore:
    """Rank 0's agent's handle on the current round's workers' store."""

    def __init__(self) -> None:
        self._server: TCPStore | None = None

    def host(self, held: socket.socket, addr: str, timeout_s: float) -> None:
        """Serve the round's workers' store on ``held`` (rank 0)."""
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

    def close(self) -> None:
        """Stop serving: the round's workers are gone (the server stops, and its port
        refuses, when the last handle on it goes)."""
        self._server = None
