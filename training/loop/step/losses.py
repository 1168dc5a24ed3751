"""A task's loss of a micro-batch, and the factor that makes a step's gradient the mean over
the whole global batch at any world size.

A loss is either the SUM of the micro-batch's per-sample losses, scaled in the backward by
``loss_scale`` (training/data/sampler.py: the global batch in samples is known before the
step), or a pair ``(sum, count)``: the sum of any per-item losses (tokens, say) and how many
items it holds. A count is known only after the forward, and an average over the global count
needs every rank's and every micro-batch's: such a sum goes backward unscaled, the counts are
summed over the ranks once per step, and the gradient, which DDP averaged over the W ranks, is
multiplied by W / (global count). That is the gradient of sum / count over the whole global
batch, whatever the world size or the micro-batching (W / W is exact in floating point).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from training.api import TaskContractError

LossValue = torch.Tensor | tuple[torch.Tensor, torch.Tensor | int | float]
"""What ``TrainSpec.loss`` returns: a sum over samples, or ``(sum, count)``."""


def split_loss(value: LossValue) -> tuple[torch.Tensor, float | None]:
    """The loss's sum, and its count (None: a sum over samples)."""
    if isinstance(value, tuple):
        loss, count = value
        return loss, float(count.detach()) if isinstance(count, torch.Tensor) else float(count)
    return value, None


@dataclass
class StepLosses:
    """One rank's losses of one step, over its micro-batches."""

    task: str
    count: float = 0.0
    """Samples (a sum over samples), or the losses' counts."""
    counted: bool | None = None
    """Whether the loss gives ``(sum, count)``; None before the first micro-batch."""
    _sum: torch.Tensor | None = None
    """The sum of the losses' sums, on the device, in float64 (a Python float's sum)."""

    def add(self, loss: torch.Tensor, count: float | None, samples: int) -> None:
        """Add a micro-batch's loss, kept on the device: reading it would block the host until
        the stream's queued work ran, the gradient all-reduce's included (``total``)."""
        counted = count is not None
        if self.counted is not None and counted != self.counted:
            raise TaskContractError(
                f"task {self.task!r}: loss returned a (sum, count) pair for some micro-batches "
                "and a plain sum for others; return the same kind every time"
            )
        self.counted = counted
        value = loss.detach().to(torch.float64)
        self._sum = value if self._sum is None else self._sum + value
        self.count += count if count is not None else samples

    def total(self) -> float:
        """The sum of the losses' sums, read to the host: only once the step's vote passed
        (training/loop/step_guard.py), so a dead peer's all-reduce cannot block the read."""
        return float(self._sum) if self._sum is not None else 0.0


def normalize_gradients(
    parameters: Iterable[torch.nn.Parameter],
    losses: StepLosses,
    world_size: int,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None,
) -> float:
    """For a ``(sum, count)`` loss: the gradients (DDP's average over ``world_size`` ranks of
    the unscaled sums) times world_size / global count; the global count (this rank's when
    ``all_reduce`` is None). A global count of 0 counted nothing: the gradient is 0."""
    if not losses.counted:
        return losses.count
    total = torch.tensor([losses.count], dtype=torch.float64)
    count = float(all_reduce(total)[0]) if all_reduce is not None else losses.count
    factor = world_size / count if count > 0 else 0.0
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.mul_(factor)
    return count
