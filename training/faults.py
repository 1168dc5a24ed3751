"""How a worker learns it must stop: a SIGTERM, or a collective that failed with a peer.

Both end the training loop at the last completed step, so both lead to the same save.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

_PEER_FAILURE_MARKERS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "timed out",
    "broken pipe",
)


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because a peer died or froze (not a bug in this process)."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(
        m in str(exc).lower() for m in _PEER_FAILURE_MARKERS
    )


class StopRequest:
    """Turns SIGTERM into a flag the loop checks at every step boundary and, with ``act_at_once``,
    into an action run at once on a thread of its own.

    Python runs signal handlers in the main thread between bytecodes, so a loop stuck in a
    collective on a frozen peer sees the flag only when the collective times out (30 s in the
    cluster), and the agent, restarting the group, waits for it. A thread blocked in
    ``sigwait`` gets the signal at once: it saves the last completed step and ends the process
    (``Trainer.stop_now``). It needs SIGTERM blocked in every other thread, so it must be made
    before any other thread starts (before the process group).
    """

    def __init__(self, act_at_once: bool = False) -> None:
        self.requested = False
        self._action: Callable[[], None] | None = None
        self._fallback: Callable[[], None] | None = None
        signal.signal(signal.SIGTERM, self._handle)  # if a thread made earlier gets it
        if act_at_once:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            threading.Thread(target=self._wait, name="sigterm", daemon=True).start()

    def on_stop(self, action: Callable[[], None]) -> None:
        """Run ``action`` (it ends the process) when SIGTERM comes; until then ``fallback``."""
        self._action = action

    def until_then(self, fallback: Callable[[], None]) -> None:
        """What a SIGTERM does before ``on_stop`` names an action (nothing trained yet)."""
        self._fallback = fallback

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def _wait(self) -> None:
        signal.sigwait({signal.SIGTERM})
        self.requested = True
        action = self._action or self._fallback
        if action is not None:
            action()
