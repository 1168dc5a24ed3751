"""State a task keeps beside the model and its optimizer, which the loop saves, restores and
updates after every optimizer step: ``TrainParts.extras``. The common one is ``EMA``."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn


class Extra(Protocol):
    """One extra: its state as a dict of tensors and values (DCP's ``Stateful``), and its
    update after each optimizer step, under the lock that keeps a save from seeing half a step.
    ``attach`` runs once the model is final (on its device, sharded under FSDP2), before any
    restore: an extra that mirrors the parameters builds its tensors there."""

    def attach(self, model: nn.Module) -> None: ...

    def update(self, model: nn.Module) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class EMA:
    """An exponential moving average of the parameters, updated after each optimizer step:
    ``shadow = decay * shadow + (1 - decay) * parameter``, starting from the parameters as
    built. Its tensors are the parameters' own kind: under FSDP2, DTensors sharded like them,
    so each rank keeps and saves its shard and a restore reshards it with the model."""

    def __init__(self, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"an EMA's decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}

    def attach(self, model: nn.Module) -> None:
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            self.shadow[name].lerp_(param.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": dict(self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, tensor in self.shadow.items():
            loaded = state_dict["shadow"][name]
            if loaded is not tensor:  # DCP loads in place; a single file brings new tensors
                tensor.copy_(loaded)
