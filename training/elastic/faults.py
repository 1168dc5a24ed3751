"""How a worker learns it must stop: a SIGTERM, or a collective that failed with a peer.

Both end the training loop at the last completed step, so both lead to the same save.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class PeerLostError(dist.DistError):
    """Raised by our own code when a collective shows that a peer did not finish a step
    (training/loop/step_guard.py)."""


# gloo's transport raises ``gloo::IoException`` for a connection to a peer that closed, failed
# or timed out, and torch hands it on as a plain RuntimeError whose text starts with the
# location gloo's GLOO_ERROR_MSG prepends: ``[.../gloo/transport/tcp/pair.cc:553] Connection
# closed by peer ...``, ``[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
# ...``. After such a timeout the context closes its pairs with an unprefixed message
# (gloo/transport/tcp/unbound_buffer.cc: ``context_->signalException``).
_GLOO_TRANSPORT = re.compile(r"^\[[^\]]*gloo/transport/[^\]]*\] ")
_GLOO_PAIRS_CLOSED = "Application timeout caused pair closure"
# NCCL's errors are all DistBackendError (torch/csrc/distributed/c10d/NCCLUtils.hpp,
# C10D_NCCL_CHECK; NCCLUtils.cpp, getNcclErrorDetailStr): a peer that exited or a network
# error is ncclRemoteError; the watchdog's timeout says so, and aborts the communicator, which
# every later call reports (NCCLComm::getNcclComm). The rest (invalid usage or argument, an
# internal, CUDA or system error: a bad NCCL setting, a too small /dev/shm) recurs on every
# restart, and the original reason travels in the message.
_NCCL_PEER_LOST = (
    "ncclRemoteError",
    "remote process exited or there was a network error",
    "Watchdog caught collective operation timeout",
    "NCCL communicator was aborted",
    "NCCL timeout in",
)
_NCCL_DETERMINISTIC = (
    "ncclInvalidUsage",
    "ncclInvalidArgument",
    "ncclInternalError",
    "ncclUnhandledCudaError",
    "ncclSystemError",
)


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because a peer died or froze (not a bug in this process).

    By what torch raises for it: the store or the network failing (``DistStoreError``,
    ``DistNetworkError``: a peer or the store's host gone while the group forms), gloo's
    transport errors, NCCL's lost-peer errors, and our step guard's ``PeerLostError``. A
    deterministic NCCL or configuration error is not one: restarting would meet it again.
    """
    if isinstance(exc, PeerLostError | dist.DistNetworkError | dist.DistStoreError):
        return True
    text = str(exc)
    if isinstance(exc, dist.DistBackendError):
        return any(m in text for m in _NCCL_PEER_LOST) and not any(
            m in text for m in _NCCL_DETERMINISTIC
        )
    if type(exc) is RuntimeError:  # how torch hands on a gloo::IoException
        return bool(_GLOO_TRANSPORT.match(text)) or text.startswith(_GLOO_PAIRS_CLOSED)
    return False


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
        self.at: float | None = None
        """When the first SIGTERM came (``time.monotonic``): the stop's deadline runs from it,
        not from when the loop, a step later, sees the flag."""
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
        self._note()

    def _note(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
        self.requested = True

    def _wait(self) -> None:
        signal.sigwait({signal.SIGTERM})
        self._note()
        action = self._action or self._fallback
        if action is not None:
            action()
