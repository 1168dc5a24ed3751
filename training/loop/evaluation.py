"""The task's evaluation every ``--eval-every`` steps: every rank evaluates its share, the loop
sums the shares, rank 0 logs the result (an ``evaluated`` event with ``eval_loss``, and the
task's line of text as ``sample`` if it gave one; the lab's report shows them).

In ``eval()`` mode and without gradients; it reads the state and changes none of it, so a run
with evaluations follows the same trajectory as one without. A sharded model is sharded again
after it (FSDP2's root keeps its parameters gathered after a forward without a backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from training.api import Data, EvalContext, TrainSpec
from training.loop.parallel import reshard


def evaluate(
    spec: TrainSpec,
    model: nn.Module,
    data: Data,
    ctx: EvalContext,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, Any] | None:
    """The global validation loss (and rank 0's text) at ``ctx.step``; None when the task
    has no evaluation or no items to evaluate."""
    if spec.evaluate is None:
        return None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            result = spec.evaluate(model, data, ctx)
    finally:
        model.train(was_training)
        reshard(model)  # a sharded root keeps its gathered parameters after a forward
    totals = all_reduce(torch.tensor([result.loss_sum, float(result.count)], dtype=torch.float64))
    if totals[1] <= 0:
        return None
    found: dict[str, Any] = {"eval_loss": round(float(totals[0] / totals[1]), 6)}
    if result.text is not None:
        found["sample"] = result.text
    return found
