"""Test support: the exceptions torch itself raises when a peer is lost, made on loopback.

gloo's and the store's come from real process groups and stores in this process (two gloo ranks
on threads, one of them aborted or idle), so a unit test that fakes a lost peer raises exactly
what a worker meets. NCCL's cannot be made without GPUs: those are torch's own exception type
with the text torch 2.13 formats (torch/csrc/distributed/c10d/NCCLUtils.hpp ``C10D_NCCL_CHECK``,
NCCLUtils.cpp ``getNcclErrorDetailStr`` and ``NCCLComm::getNcclComm``, ProcessGroupNCCL.cpp
``WorkNCCL::checkTimeout``).
"""

from __future__ import annotations

import gc
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist


def gloo_pair(timeout_s: float) -> list[dist.ProcessGroupGloo]:
    """Two connected gloo ranks of one group, made on two threads over one HashStore."""
    store = dist.HashStore()
    groups: list[dist.ProcessGroupGloo | None] = [None, None]

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert groups[0] is not None and groups[1] is not None
    return [groups[0], groups[1]]


def allreduce_error(group: dist.ProcessGroupGloo) -> RuntimeError:
    try:
        group.allreduce([torch.ones(1)]).wait()
    except RuntimeError as exc:
        return exc
    raise AssertionError("the all-reduce completed without its peer")


def gloo_peer_closed() -> RuntimeError:
    """A peer's process went away mid-group: gloo's 'Connection closed by peer'."""
    mine, theirs = gloo_pair(timeout_s=30)
    del theirs  # its sockets close, as a killed process's do
    gc.collect()
    return allreduce_error(mine)


def gloo_peer_timed_out(timeout_s: float = 0.2) -> RuntimeError:
    """A peer that never answers (frozen, or a VM gone without an RST): gloo's timeout."""
    mine, _ = gloo_pair(timeout_s=timeout_s)
    return allreduce_error(mine)


def store_timed_out() -> dist.DistStoreError:
    """A peer that never came to the group's store (init_process_group's rendezvous)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=0.1), wait_for_workers=False
    )
    try:
        store.get("a key a lost peer was to write")
    except dist.DistStoreError as exc:
        return exc
    raise AssertionError("the store answered")


def store_unreachable() -> dist.DistNetworkError:
    """The group's store host (rank 0's node) is gone: nothing listens on its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=0.2))
    except dist.DistNetworkError as exc:
        return exc
    raise AssertionError("a store answered on a free port")


_NCCL_AT = "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
_NCCL_VERSION = ", NCCL version 2.27.5\n"
NCCL_REMOTE_ERROR = (
    f"{_NCCL_AT}remote process exited or there was a network error{_NCCL_VERSION}"
    "ncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely.\nLast error:\nsocketProgress: Connection closed by remote peer"
)
NCCL_WATCHDOG_TIMEOUT = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=30000) ran for 30012 milliseconds "
    "before timing out."
)
NCCL_ABORTED_AFTER_TIMEOUT = (
    "NCCL communicator was aborted on rank 1.  Original reason for failure was: "
    + NCCL_WATCHDOG_TIMEOUT
)
NCCL_INVALID_USAGE = (
    f"{_NCCL_AT}invalid usage (run with NCCL_DEBUG=WARN for details){_NCCL_VERSION}"
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library."
)
NCCL_NO_SHM = (
    f"{_NCCL_AT}unhandled system error (run with NCCL_DEBUG=INFO for details){_NCCL_VERSION}"
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
    "device error. \nLast error:\nError while creating shared memory segment "
    "/dev/shm/nccl-Xy12Ab (size 9637888)"
)
NCCL_ABORTED_AFTER_INVALID_USAGE = (
    "NCCL communicator was aborted on rank 0.  Original reason for failure was: "
    + NCCL_INVALID_USAGE
)


def nccl_error(text: str) -> dist.DistBackendError:
    """What ProcessGroupNCCL raises (every NCCL failure is a DistBackendError), with ``text``."""
    return dist.DistBackendError(text)
