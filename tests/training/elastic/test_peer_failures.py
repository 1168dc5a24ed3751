"""A lost peer is recognised by what torch raises for it, not by words in any error.

A worker that takes a deterministic error for a lost peer exits 75 on every restart, then its
node 138 once the budget is spent, and the operator makes new pods forever
(training/elastic/faults.py, training/elastic/exit_codes.py). One that takes a lost peer for a
bug exits 1 and fails the job.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.faulty_device_task import ECC_ERROR
from tests.support.peer_failures import (
    NCCL_ABORTED_AFTER_INVALID_USAGE,
    NCCL_ABORTED_AFTER_TIMEOUT,
    NCCL_INVALID_USAGE,
    NCCL_NO_SHM,
    NCCL_REMOTE_ERROR,
    NCCL_WATCHDOG_TIMEOUT,
    allreduce_error,
    gloo_pair,
    gloo_peer_closed,
    gloo_peer_timed_out,
    nccl_error,
    store_timed_out,
    store_unreachable,
)
from training.elastic.faults import PeerLostError, is_device_fault, is_peer_failure


@pytest.mark.parametrize(
    "make",
    [
        gloo_peer_closed,
        gloo_peer_timed_out,
        store_timed_out,
        store_unreachable,
        lambda: nccl_error(NCCL_REMOTE_ERROR),
        lambda: nccl_error(NCCL_WATCHDOG_TIMEOUT),
        lambda: nccl_error(NCCL_ABORTED_AFTER_TIMEOUT),
        lambda: PeerLostError("step guard: 1 ranks finished the step"),
    ],
    ids=[
        "gloo-connection-closed",
        "gloo-timeout",
        "store-timeout",
        "store-unreachable",
        "nccl-remote-error",
        "nccl-watchdog-timeout",
        "nccl-aborted-after-timeout",
        "step-guard",
    ],
)
def test_what_torch_raises_for_a_lost_peer_is_a_peer_failure(make) -> None:
    assert is_peer_failure(make())


def test_after_a_gloo_timeout_the_next_collective_is_a_peer_failure_too() -> None:
    # gloo closes the group's pairs after a timeout: the loop's next collective meets that.
    mine, _ = gloo_pair(timeout_s=0.2)
    assert is_peer_failure(allreduce_error(mine))
    assert is_peer_failure(allreduce_error(mine))


@pytest.mark.parametrize(
    "exc",
    [
        nccl_error(NCCL_INVALID_USAGE),
        nccl_error(NCCL_NO_SHM),  # a too small /dev/shm: the same on every restart
        nccl_error(NCCL_ABORTED_AFTER_INVALID_USAGE),
        dist.DistBackendError("Backend nccl does not support allgather_coalesced"),
        RuntimeError("NCCL error: unhandled cuda error, NCCL version 2.27.5"),
        RuntimeError(
            "[enforce fail at /pytorch/third_party/gloo/gloo/allreduce.cc:56] "
            "opts.elements > 0. Tensor must not be empty"
        ),
        RuntimeError("the gloo backend timed out? no: a bug that mentions the words"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ValueError("[gloo/transport/tcp/pair.cc:1] not a RuntimeError"),
    ],
    ids=[
        "nccl-invalid-usage",
        "nccl-system-error",
        "nccl-aborted-after-invalid-usage",
        "backend-unsupported",
        "nccl-words-in-a-runtime-error",
        "gloo-enforce",
        "words-only",
        "out-of-memory",
        "not-a-runtime-error",
    ],
)
def test_a_deterministic_error_is_not_a_peer_failure(exc: BaseException) -> None:
    assert not is_peer_failure(exc)


@pytest.mark.parametrize(
    ("exc", "device"),
    [
        (torch.AcceleratorError(ECC_ERROR), True),
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: unspecified launch failure"), True),
        (RuntimeError("NVML: GPU is lost (Xid 79: GPU has fallen off the bus)"), True),
        (nccl_error("unhandled cuda error\nncclUnhandledCudaError: Call to CUDA failed"), True),
        (nccl_error(NCCL_NO_SHM), False),  # a setting of the pod: the same on every node
        (torch.AcceleratorError("CUDA error: device-side assert triggered"), False),  # a bug
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (nccl_error(NCCL_REMOTE_ERROR), False),  # a peer's, not this node's
        (ValueError("uncorrectable ECC error encountered"), False),
    ],
    ids=[
        "ecc",
        "illegal-address",
        "launch-failure",
        "fallen-off-the-bus",
        "nccl-cuda",
        "nccl-no-shm",
        "device-side-assert",
        "out-of-memory",
        "nccl-remote",
        "words-only",
    ],
)
def test_a_fault_of_this_nodes_gpu_is_told_from_a_bug_and_from_a_peers(
    exc: BaseException, device: bool
) -> None:
    assert is_device_fault(exc) is device
    assert not (device and is_peer_failure(exc))
