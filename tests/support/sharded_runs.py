"""A rank's training on its share of one global batch, the same trajectory at any world size:
the model plain, under DDP or sharded by FSDP2, its optimizer, scheduler and EMA (sharded like
the parameters), as the sharded checkpoints' tests save and load it."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from training.checkpoints.sharded.state import (
    ModelState,
    TrainerState,
    training_state,
)

GLOBAL_BATCH = 12
SAVE_AT, STEPS = 3, 6
SAVED_SEED, OTHER_SEED = 0, 99


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=torch.float64)
    return x, torch.randn(GLOBAL_BATCH, 3, generator=generator, dtype=torch.float64)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]
    return torch.nn.Sequential(*layers).double()


class EMA(Stateful):
    """A task's extra: an average of the parameters (DTensors, sharded, under FSDP2)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            self.shadow[name].mul_(0.9).add_(param.detach(), alpha=0.1)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": dict(self.shadow)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, tensor in self.shadow.items():
            tensor.copy_(state_dict["shadow"][name])  # DCP loaded in place: a no-op here


class Run:
    """One rank's training: the model (wrapped), its optimizer, scheduler, EMA, trainer state."""

    def __init__(self, mode: str, seed: int, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.model = _model(seed)
        self.wrapped = _parallelize(self.model, mode, world)
        self.optimizer = torch.optim.AdamW(self.wrapped.parameters(), lr=0.05, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.ema = EMA(self.model)
        self.trainer = TrainerState(scheduler=self.scheduler, extras={"ema": self.ema})
        self.state = training_state(ModelState(self.wrapped, self.optimizer), self.trainer)

    def train_to(self, steps: int) -> None:
        while self.trainer.step < steps:
            x, y = _batch(self.trainer.step)
            share = list(range(self.rank, GLOBAL_BATCH, self.world))
            # The optimizer sees the global batch's mean gradient at any world size (DDP and
            # FSDP2 average the ranks' gradients).
            out = self.wrapped(x[share])
            loss = ((out - y[share]) ** 2).sum() / GLOBAL_BATCH * self.world
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.ema.update(self.model)
            self.trainer.step += 1
            self.trainer.consumed_samples += GLOBAL_BATCH

    def full(self) -> dict[str, torch.Tensor]:
        """The parameters and the EMA whole (a collective under FSDP2)."""
        found = {}
        parts = (("", self.model.named_parameters()), ("ema.", self.ema.shadow.items()))
        for prefix, named in parts:
            for name, tensor in named:
                whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                found[prefix + name] = whole.detach().clone()
        return found


def _parallelize(model: torch.nn.Module, mode: str, world: int) -> torch.nn.Module:
    if mode == "reference":
        return model
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)
