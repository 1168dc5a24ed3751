"""The character LM with a hook that stops one node inside a step's backward (tests only).

A node started with ``SIGNAL_IN_BACKWARD_ENV=<step>`` (1-based, the step in flight) writes
``SIGNAL_MARKER_ENV``'s file as that step's backward starts (once: a later worker of the node
that trains the step again finds the file and goes through), then holds its backward there
until the worker's SIGTERM reached it (the test signals the node on seeing the file): the
SIGTERM then lands with the step's gradient collectives still to come, on every rank. The
task is the character LM as it is, named by reference: ``--task=tests.support.signalled_task:SPEC``.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from training.api import TrainSpec
from training.elastic.faults import StopRequest
from training.tasks.charlm import SPEC as CHARLM

SIGNAL_IN_BACKWARD_ENV = "TEST_SIGNAL_IN_BACKWARD"
SIGNAL_MARKER_ENV = "TEST_SIGNAL_MARKER"
TASK = "--task=tests.support.signalled_task:SPEC"
HOLD_S = 60.0
"""How long the backward waits for the SIGTERM at most (the test signals within a second)."""


def _stop_request() -> StopRequest | None:
    """The worker's own StopRequest (made by training/train.py before any thread)."""
    with warnings.catch_warnings():  # isinstance on some of torch's objects warns
        warnings.simplefilter("ignore")
        return next((o for o in gc.get_objects() if isinstance(o, StopRequest)), None)


def _hold(grad: torch.Tensor) -> torch.Tensor:
    Path(os.environ[SIGNAL_MARKER_ENV]).write_text(str(os.getpid()))
    stop, give_up = _stop_request(), time.monotonic() + HOLD_S
    while stop is not None and not stop.requested and time.monotonic() < give_up:
        time.sleep(0.001)
    return grad


def _loss(model: Any, batch: Any, where: Any) -> Any:
    value = CHARLM.loss(model, batch, where)
    at, marker = os.environ.get(SIGNAL_IN_BACKWARD_ENV), os.environ.get(SIGNAL_MARKER_ENV)
    # Once per node: a worker of the next round that trains the step again goes through.
    if at and marker and where.step + 1 == int(at) and not Path(marker).exists():
        loss = value[0] if isinstance(value, tuple) else value
        loss.register_hook(_hold)  # the first thing backward runs
    return value


SPEC: TrainSpec = replace(CHARLM, loss=_loss)
