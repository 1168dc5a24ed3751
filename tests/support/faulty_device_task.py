"""CIFAR-10 on a GPU that fails on cue, on the CPU: the task a test gives its nodes (``--task
tests.support.faulty_device_task:spec``), through the one seam a user's model has.

``TRAIN_FAULTY_DEVICE=<step>`` in a node's environment makes its first local worker raise, in
every micro-batch's loss from optimiser step ``<step>`` on, the error torch raises for an
uncorrectable ECC error (a ``torch.AcceleratorError`` with CUDA's text): what a GPU that went
bad mid-run does, every step and every restart on that node, until the node is replaced.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from training.api import MicroBatch, TrainSpec
from training.tasks import cifar

FAULTY_DEVICE_ENV = "TRAIN_FAULTY_DEVICE"
ECC_ERROR = (
    "CUDA error: uncorrectable ECC error encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect."
)
"""The text of ``C10_CUDA_CHECK`` for cudaErrorECCUncorrectable (c10/cuda/CUDAException.h)."""
TASK = "tests.support.faulty_device_task:spec"


def loss(model: nn.Module, batch: Any, where: MicroBatch) -> Any:
    at = os.environ.get(FAULTY_DEVICE_ENV)
    if at and os.environ.get("LOCAL_RANK", "0") == "0" and where.step >= int(at):
        raise torch.AcceleratorError(ECC_ERROR)
    return cifar.loss(model, batch, where)


# The same name as CIFAR-10's: the nodes' checkpoints are one task's.
spec: TrainSpec = dataclasses.replace(cifar.SPEC, loss=loss)
