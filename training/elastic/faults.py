"""How a worker learns it must stop: a SIGTERM, or a collective that failed with a peer.

Both end the training loop at the last completed step, so both lead to the same save.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
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
# every later call reports (NCCLComm::getNcclComm). None of the rest is a lost peer: a CUDA or
# system error is this node's device (``is_device_fault``), and invalid usage or argument or
# an internal error recurs on every restart. The original reason travels in the message.
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


# A fault of this node's device, by the text torch hands on. CUDA's runtime errors reach Python
# as torch.AcceleratorError, a RuntimeError (c10/util/Exception.h), whose message is "CUDA
# error: " and cudaGetErrorString's text for the cudaError_t (C10_CUDA_CHECK,
# c10/cuda/CUDAException.h); the comments name the cudaError_t and the driver's Xid that
# raises it. NCCL's reach Python as DistBackendError naming the ncclResult_t (nccl.h).
_DEVICE_FAULTS = (
    "ncclUnhandledCudaError",  # NCCL's own call into CUDA failed: the device under it
    "ncclSystemError",  # a system call, or the device, failed on this node
    "uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable (Xid 48, 63, 64)
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress (Xid 13, 31)
    "unspecified launch failure",  # cudaErrorLaunchFailure (Xid 13, 43: a kernel killed)
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    "hardware stack error",  # cudaErrorHardwareStackError
    "CUDA-capable device(s) is/are busy or unavailable",  # cudaErrorDevicesUnavailable
    "GPU has fallen off the bus",  # the driver's Xid 79 text, as NVML's checks report it
    "GPU is lost",  # NVML_ERROR_GPU_IS_LOST (after Xid 79)
)
_NOT_THE_DEVICE = (
    "device-side assert triggered",  # cudaErrorAssert: the program's own check
    "Error while creating shared memory segment",  # /dev/shm too small: the pod's spec
)


def is_device_fault(exc: BaseException) -> bool:
    """A CUDA or NCCL error that comes from this node's GPU: no restart on this node fixes
    it, and a node elsewhere does not meet it. A device-side assert is the program's, and a
    /dev/shm too small for NCCL the same on every node."""
    if not isinstance(exc, RuntimeError):  # AcceleratorError and DistBackendError are ones
        return False
    text = str(exc)
    return any(m in text for m in _DEVICE_FAULTS) and not any(m in text for m in _NOT_THE_DEVICE)


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


AGENT_SIGNALLED_ENV = "TRAIN_AGENT_SIGNALLED_FILE"
"""A file the warm launcher's agent writes when a SIGTERM reaches it from outside (an eviction,
the pod deleted), before it stops its workers with one of its own."""


def sigterm_from_outside() -> bool:
    """Whether this worker's SIGTERM means the node goes (its agent was signalled), not torch
    closing the node's workers: a sibling exited (torch 2.13 ``MultiprocessContext`` closes
    the others, elastic/multiprocessing/api.py) or the group re-forms. Either way the worker
    saves on the node; only a node that goes needs the durable commit. Outside the warm
    launcher (plain torchrun, a single process) every SIGTERM counts."""
    signalled = os.environ.get(AGENT_SIGNALLED_ENV)
    return not signalled or Path(signalled).exists()


AGREEMENT_TIMEOUT_S = 10.0
"""How long a rank that raised waits for its peers to say they raised too. Ranks that all meet
the same error (a task's bug) meet it in the same step, well within this."""


def every_rank_raised(
    exc: BaseException,
    group: dist.ProcessGroup | None,
    timeout_s: float = AGREEMENT_TIMEOUT_S,
) -> bool:
    """Whether every rank of ``group`` (a gloo group) failed with ``exc``'s class: an error
    every rank reproduces, which no restart fixes.

    The ranks that raised meet in a monitored barrier, then compare their errors' classes.
    A rank that did not raise is still training, in a collective that waits for this one, and
    never comes: the barrier times out within ``timeout_s`` (a dead peer cannot hang it
    either), and the error is this rank's alone.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return True
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        names: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, type(exc).__qualname__, group=group)
    except Exception:  # noqa: BLE001 - a peer that did not come, or left: not every rank
        return False
    return len(set(names)) == 1


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
