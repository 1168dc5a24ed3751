"""``--precision``: the dtype the forward and the loss compute in, owned by the loop.

``fp32``: the run's dtype throughout. ``bf16-mixed`` and ``fp16-mixed``: ``torch.autocast``
around the task's forward and loss (and its evaluation) on the run's device type; the
parameters, the gradients, the optimizer's state and every checkpoint stay in float32.
fp16's narrow range needs loss scaling: a ``torch.amp.GradScaler`` scales the loss before the
backward, unscales the gradients before clipping, skips a step whose gradients overflowed
and adapts its scale (PyTorch's AMP recipe, docs.pytorch.org/docs/stable/amp.html). Its scale
and growth tracker are state: a resume without them would rescale differently from the
uninterrupted run, so they are saved and restored with the model.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class Precision:
    """The autocast and, for fp16, the gradient scaler of one run."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device_type = device.type
        self.dtype = AUTOCAST_DTYPES.get(name)
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16-mixed" else None

    def autocast(self) -> AbstractContextManager[Any]:
        """Around the task's forward and loss (nothing for fp32)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients as the loss gives them: before clipping reads their norm."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step; with a scaler, skipped when a gradient overflowed (every rank
        alike: the gradients are all-reduced), and the scale updated."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
