"""The API's checks of a task: what would break exact resume is refused, with the fix.

Two ways a task can break it without any error of its own:

- **Randomness from a per-rank stream.** A task that draws from torch's global RNG in its loss
  (``nn.Dropout``, ``torch.rand``) gives a sample other random numbers at another world size
  (another rank draws for it, after other samples), so a run that changed size leaves the
  uninterrupted trajectory. ``checked_loss`` compares the global generators' state around the
  task's loss and raises at the first micro-batch that moved them.
- **State kept outside the checkpoint.** A scheduler the loop was not given, a private
  ``torch.Generator``, a counter in a closure: all survive in memory but not in a restore.
  ``rehearse_resume`` takes one step from the state as it is, then the same step again from
  the state as a checkpoint restores it (serialized and loaded back into the same objects),
  and compares the loss, the learning rates and the parameters' update. Hidden state has
  moved on by then, so the second step differs. It runs once per round, on each rank, before
  DDP: local computation only, no collective, and the state is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from training.api import MicroBatch, TaskContractError
from training.checkpoints.serialization import deserialize, serialize

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
) -> tuple[list[float], list[torch.Tensor]]:
    lrs = [float(group["lr"]) for group in optimizer.param_groups]
    return lrs, [p.detach().to("cpu", torch.float64, copy=True) for p in model.parameters()]


def _differs(a: torch.Tensor, b: torch.Tensor, start: torch.Tensor) -> bool:
    """Whether two updates from ``start`` differ by more than rounding."""
    size = max(float((a - start).abs().max()), float((b - start).abs().max()))
    return float((a - b).abs().max()) > RELATIVE_TOLERANCE * size


def rehearse_resume(
    task: str,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
    one_step: Callable[[], float],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Take ``one_step`` twice from the same state, the second time from that state as a
    checkpoint restores it; TaskContractError when they differ. The state is restored after.
    """
    saved = serialize(state_dict())
    start = [p.detach().to("cpu", torch.float64, copy=True) for p in model.parameters()]
    try:
        first_loss = one_step()
        first_lrs, first = _fingerprint(optimizer, model)
        load_state_dict(deserialize(saved))
        second_loss = one_step()
        second_lrs, second = _fingerprint(optimizer, model)
    finally:
        load_state_dict(deserialize(saved))
    problems = []
    if first_lrs != second_lrs:
        problems.append(f"learning rates {first_lrs} then {second_lrs}")
    if abs(first_loss - second_loss) > RELATIVE_TOLERANCE * max(abs(first_loss), 1e-12):
        problems.append(f"loss {first_loss!r} then {second_loss!r}")
    moved = [1 for a, b, s in zip(first, second, start, strict=True) if _differs(a, b, s)]
    if moved:
        problems.append(f"the update of {len(moved)} parameter tensor(s)")
    if problems:
        raise TaskContractError(
            f"task {task!r} keeps state outside the checkpoint: the same step taken again from "
            f"the restored state gave {'; '.join(problems)}. Hand the LR scheduler to the loop "
            "(TrainParts.scheduler), draw randomness from where.sample_seeds(stream), and keep "
            "no counters of your own (docs/your-own-model.md, what breaks exactness)"
        )
