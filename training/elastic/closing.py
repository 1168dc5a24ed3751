"""Why a run's rendezvous closed, as its ``state`` key keeps it, and what a node that finds
it closed makes of it.

The agent closes the rendezvous when the run is over for good: it finished, or it failed in a
way no new pod fixes (training/agent.py, ``_ending``). The value under ``closed`` says which,
so a node that starts after the end (a replacement pod scheduled as training ended, a slow cold
start) exits 0 for a finished run: under the operator's ExitCode policy, its exit 1 could turn
the finished run into a Failed job (tests/training/test_late_join.py cites the operator). A
key closed before the reason was kept (``closed: true``) reads as it always did: exit 1, "the
run finished, or failed for good".
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from training.elastic.etcd_v3 import EtcdError
from training.elastic.membership import Membership

logger = logging.getLogger("training.elastic.rendezvous")  # the handler's lines, as before

__all__ = [
    "FAILED",
    "Closing",
    "FINISHED",
    "RunFailedError",
    "RunFinishedError",
    "closed_error",
    "closed_value",
    "why",
]

FINISHED = "finished"
"""The run trained to its end: a node that comes later has nothing to do."""
FAILED = "failed"
"""The run failed for good (bad input, a bug no restart fixed, too few nodes at the start)."""


class RunFinishedError(RendezvousClosedError):
    """The rendezvous closed because the run finished: nothing is left for this node."""


class RunFailedError(RendezvousClosedError):
    """The rendezvous closed because the run failed for good: this node cannot save it."""


def why(code: int) -> str:
    """The reason a closing agent records for its own ending's exit ``code``."""
    return FINISHED if code == 0 else FAILED


def closed_value(state: dict[str, Any], why_closed: str) -> dict[str, Any]:
    """``state`` closed for ``why_closed``; the first agent's reason stays (a peer that ends
    otherwise a moment later does not rewrite why the run ended)."""
    return {**state, "closed": state.get("closed") or why_closed}


def closed_error(run_id: str, state: dict[str, Any]) -> RendezvousClosedError:
    """What a node that finds ``run_id``'s ``state`` closed raises, by the reason it reads."""
    closed = state.get("closed")
    if closed == FINISHED:
        return RunFinishedError(f"rendezvous {run_id} is closed: the run finished")
    if closed == FAILED:
        return RunFailedError(f"rendezvous {run_id} is closed: the run failed for good")
    return RendezvousClosedError(f"rendezvous {run_id} is closed")  # closed with no reason


class Closing:
    """One node's part in its run's end: it closes the rendezvous saying why, or finds it
    closed (training/elastic/rendezvous.py holds one per handler)."""

    def __init__(self, keys: Membership, run_id: str) -> None:
        self.keys, self.run_id = keys, run_id
        self.closed_by_us = False
        self.found_closed = False
        """This node found the run closed as it joined: it neither closes nor reopens it."""

    def is_closed(self) -> bool:
        state = self.keys.read_state()[0]
        return bool(state and state.get("closed"))

    def close(self, why_closed: str, round_: int) -> None:
        self.keys.update_state(lambda s: closed_value(s, why_closed), round_)

    def settle(self, close: bool, why_closed: str, round_: int) -> None:
        """Close for good (the run is over: ``why_closed``), or say it stays open."""
        if close and not self.closed_by_us:
            try:
                self.close(why_closed, round_)
                self.closed_by_us = True
                logger.info("rendezvous %s closed: the run is over (%s)", self.run_id, why_closed)
            except EtcdError as exc:
                logger.error("could not close rendezvous %s: %s", self.run_id, exc)
        elif not close and not self.found_closed:
            logger.info("rendezvous %s left open for a new pod to join", self.run_id)

    def found(self, state: dict[str, Any]) -> RendezvousClosedError:
        """What this node raises on finding the run's ``state`` closed."""
        self.found_closed = True
        return closed_error(self.run_id, state)
