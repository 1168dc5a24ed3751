"""How a worker learns it must stop: a SIGTERM, or a collective that failed with a peer.

Both end the training loop at the last completed step, so both lead to the same save.
"""

from __future__ import annotations

import signal
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
    """Turns SIGTERM into a flag the loop checks at every step boundary."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
