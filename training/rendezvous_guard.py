"""The rendezvous, closed only when the run is over for good.

torch's launcher (``launch_agent`` in ``torch/distributed/launcher/api.py``) shuts the
rendezvous handler down whenever its agent ends, except on a signal, and the dynamic handler's
``shutdown`` *closes* the rendezvous id: every node that comes later is refused. On Spot nodes
that is wrong in one case that matters. Every eviction makes the survivors' workers fail (their
collective loses a peer), which spends one of their agent's restarts; after ``maxRestarts``
evictions the agent gives up, and closing the id then fails the whole job, although a new pod,
with a fresh budget, could have joined and trained on.

So the agent runs torch's own handler (built through the public handler registry) behind this
thin wrapper, registered under a backend name of ours. ``shutdown`` does nothing by itself; the
agent decides afterwards (``training/agent.py``) and calls ``settle``: close when the run
finished or failed for good, leave open when it only ran out of restarts.

The wrapper also stops a node at once when one of its workers found bad input after joining
(a checkpoint of another run, data that went away): the worker leaves a verdict file, and the
next round's ``next_rendezvous`` raises instead of spending the rest of the budget on it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from training.exit_codes import VERDICT_ENV

logger = logging.getLogger(__name__)

PREFIX = "guarded-"
_created: list[GuardedRendezvous] = []


class BadInputAfterJoin(RuntimeError):
    """A worker of this node found input no restart fixes; its log says which."""


class GuardedRendezvous(RendezvousHandler):
    """torch's handler, except that the agent, not the launcher, decides when to close it."""

    def __init__(self, inner: RendezvousHandler, backend: str, verdict: Path | None) -> None:
        self.inner = inner
        self.backend = backend
        self.verdict = verdict
        self.shutdown_requested = False
        self.closed_by_us = False

    def get_backend(self) -> str:
        return self.backend

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        if self.verdict is not None and self.verdict.exists():
            raise BadInputAfterJoin(
                f"a worker stopped on input no restart fixes: {self.verdict.read_text().strip()}"
            )
        return self.inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        """Called by torch's launcher whatever the outcome: noted, the agent settles it."""
        self.shutdown_requested = True
        return True

    def settle(self, close: bool) -> None:
        """Close the rendezvous for good (the run is over), or leave it open for a new pod."""
        if close and not self.closed_by_us:
            self.closed_by_us = self.inner.shutdown()
            logger.info("rendezvous %s closed: the run is over", self.get_run_id())
        elif not close:
            logger.info("rendezvous %s left open for a new pod to join", self.get_run_id())


def register(inner_backend: str) -> str:
    """Register the guarded twin of ``inner_backend`` (once); the name to launch with."""
    name = PREFIX + inner_backend
    rendezvous_handler_registry.register(name, _create)
    return name


def _create(params: RendezvousParameters) -> GuardedRendezvous:
    inner_params = RendezvousParameters(
        backend=params.backend.removeprefix(PREFIX),
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **params.config,
    )
    inner = rendezvous_handler_registry.create_handler(inner_params)
    verdict = os.environ.get(VERDICT_ENV)
    handler = GuardedRendezvous(inner, params.backend, Path(verdict) if verdict else None)
    _created.append(handler)
    return handler


def created() -> list[GuardedRendezvous]:
    """The handlers this process's agent made (one per launch)."""
    return list(_created)
