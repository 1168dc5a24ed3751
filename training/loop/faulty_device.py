"""A GPU that fails on cue, on the CPU: for tests and the chaos bench only.

``TRAIN_FAULTY_DEVICE=<step>`` in a node's environment makes its first local worker raise,
before any step from ``<step>`` on, the error torch raises for an uncorrectable ECC error (a
``torch.AcceleratorError`` with CUDA's text): what a GPU that went bad mid-run does, every step
and every restart on that node, until the node is replaced. Nothing in the cluster sets it.
"""

from __future__ import annotations

import os

import torch

FAULTY_DEVICE_ENV = "TRAIN_FAULTY_DEVICE"
ECC_ERROR = (
    "CUDA error: uncorrectable ECC error encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect."
)
"""The text of ``C10_CUDA_CHECK`` for cudaErrorECCUncorrectable (c10/cuda/CUDAException.h)."""


def raise_if_failed(step: int, local_rank: int) -> None:
    """Raise the device's error when this node's env says it fails by ``step``."""
    at = os.environ.get(FAULTY_DEVICE_ENV)
    if at and local_rank == 0 and step >= int(at):
        raise torch.AcceleratorError(ECC_ERROR)
