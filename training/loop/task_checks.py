"""The API's checks of a task: what would break exact resume is refused, with the fix.

Two ways a task can break it without any error of its own:

- **Randomness from a per-rank stream.** A task that draws from torch's global RNG in its loss
  (``nn.Dropout``, ``torch.rand``) gives a sample other random numbers at another world size
  (another rank draws for it, after other samples), so a run that changed size leaves the
  uninterrupted trajectory. ``checked_loss`` compares the global generators' state around the
  task's loss and raises at the first micro-batch that moved them.
- **State kept outside the checkpoint.** A scheduler the loop was not given, a private
  ``torch.Generator``, a counter in a closure: all survive in memory but not in a restore.
  ``rehearse_resume`` takes one micro-batch's forward and backward from the state as it is,
  then again after putting back what a restore would (the learning rates, the scheduler, the
  RNG streams, the buffers: the parameters and the optimizer's moments are not changed by a
  pass, so no copy of them is made, at any size), and compares the loss, the learning rates
  and each gradient's norm. Hidden state has moved on by then, so the second pass differs.
  It runs once per round on each rank (before DDP wraps the model; under FSDP2 every rank
  together), and what it changed is put back afterwards. Hidden state read only by
  ``optimizer.step`` (an optimizer whose own state_dict misses some) is not seen: the step
  is not taken, which is what makes the check cheap.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from training.api import Data, MicroBatch, TaskContractError, is_stream


def check_data(task: str, data: Any) -> None:
    """TaskContractError naming the field when ``load_data`` returned no ``Data``, or training
    samples without a ``digest`` str (a stream: without an ``identity`` str): the run's
    identity holds it, so a state is never resumed over other data of the same size."""
    if not isinstance(data, Data):
        raise TaskContractError(
            f"task {task!r}: load_data must return a training.api.Data, got {type(data).__name__}"
        )
    field = "identity" if is_stream(data.train) else "digest"
    if not hasattr(data.train, field):
        raise TaskContractError(
            f"task {task!r}: Data.train ({type(data.train).__name__}) has no {field}: give it a "
            f"property {field} -> str (a SHA-256 of its content: docs/your-own-model.md)"
        )
    value = getattr(data.train, field)
    if not isinstance(value, str) or not value:
        got = f"{type(value).__name__} {value!r:.40}"
        if isinstance(value, bytes):  # the common slip: hashlib's digest() for hexdigest()
            got = "bytes (hashlib's .hexdigest() is the str, .digest() the bytes)"
        raise TaskContractError(
            f"task {task!r}: Data.train.{field} must be a non-empty str (a SHA-256 hex digest "
            f"of the content), got {got}"
        )


RELATIVE_TOLERANCE = 1e-4
"""Rehearsal differences allowed relative to the step's own size: none on the CPU, where the
same step gives the same bits; nondeterministic GPU kernels differ at rounding level."""


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def checked_loss(
    loss: Callable[[nn.Module, Any, MicroBatch], Any],
    task: str,
    model: nn.Module,
    batch: Any,
    where: MicroBatch,
) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """``loss(model, batch, where)``, refused unless it is a scalar or a (scalar, count) pair
    and left torch's global RNG untouched."""
    before = _rng_states(where.device)
    value = loss(model, batch, where)
    after = _rng_states(where.device)
    if any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)):
        raise TaskContractError(
            f"task {task!r} drew from torch's global RNG in its loss (nn.Dropout, torch.rand, "
            "...): that stream is per rank, so a sample gets other random numbers at another "
            "world size and a resumed run leaves the uninterrupted one. Draw from "
            "where.sample_seeds(stream) instead (training.api.keyed_dropout for dropout)"
        )
    total, count = value if isinstance(value, tuple) and len(value) == 2 else (value, 0)
    if not _is_scalar(total) or not (_is_scalar(count) or _is_number(count)) or _negative(count):
        raise TaskContractError(
            f"task {task!r}: loss must return a scalar tensor (the sum of the micro-batch's "
            "per-sample losses) or a pair (sum, count) of a scalar tensor and the count "
            f">= 0 it sums over, got {_described(value)}"
        )
    return value


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _negative(count: Any) -> bool:
    return float(count) < 0


def _described(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_described(v) for v in value) + ")"
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ""
    return f"{type(value).__name__} {shape}".strip()


def _fingerprint(
    optimizer: torch.optim.Optimizer, model: nn.Module
) -> tuple[list[float], list[float]]:
    """The learning rates, and each gradient's norm (of this rank's shard, under FSDP2)."""
    lrs = [float(group["lr"]) for group in optimizer.param_groups]
    norms = []
    for param in model.parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
        norms.append(
            0.0 if grad is None else float(torch.linalg.vector_norm(grad, dtype=torch.float64))
        )
    return lrs, norms


def _differs(a: float, b: float) -> bool:
    return abs(a - b) > RELATIVE_TOLERANCE * max(abs(a), abs(b), 1e-12)


def rehearse_resume(
    task: str,
    small_state: Callable[[], Any],
    load_small_state: Callable[[Any], None],
    one_pass: Callable[[], float],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> float:
    """Take ``one_pass`` (one micro-batch forward and backward, no optimizer step) twice from
    the same state, the second time after putting back what a restore puts back besides the
    parameters and the optimizer's moments, which a pass does not change: ``small_state``
    (the learning rates, the scheduler, the RNG streams, the buffers). TaskContractError when
    the loss, the learning rates or a gradient differ. Its cost in seconds: two passes and
    copies of small things, whatever the size of the model."""
    started = time.perf_counter()
    saved = copy.deepcopy(small_state())
    try:
        first_loss = one_pass()
        first_lrs, first = _fingerprint(optimizer, model)
        load_small_state(copy.deepcopy(saved))
        second_loss = one_pass()
        second_lrs, second = _fingerprint(optimizer, model)
    finally:
        load_small_state(saved)
        optimizer.zero_grad(set_to_none=True)
    problems = []
    if first_lrs != second_lrs:
        problems.append(f"learning rates {first_lrs} then {second_lrs}")
    if _differs(first_loss, second_loss):
        problems.append(f"loss {first_loss!r} then {second_loss!r}")
    moved = [1 for a, b in zip(first, second, strict=True) if _differs(a, b)]
    if moved:
        problems.append(f"the gradient of {len(moved)} parameter tensor(s)")
    if problems:
        raise TaskContractError(
            f"task {task!r} keeps state outside the checkpoint: the same step taken again from "
            f"the restored state gave {'; '.join(problems)}. Hand the LR scheduler to the loop "
            "(TrainParts.scheduler), draw randomness from where.sample_seeds(stream), and keep "
            "no counters of your own (docs/your-own-model.md, what breaks exactness)"
        )
    return time.perf_counter() - started
