"""The model the FSDP2 cases train: a stack of square ``nn.Linear`` layers, each sharded on its
own (``fully_shard``) as soon as it is built, so no rank ever holds more than one whole layer;
AdamW keeps two moments per parameter, so the training state is three times the parameters."""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MIB = 1024 * 1024
LAYER_BYTES = 64 * MIB
"""One layer's parameters (4096 x 4096 float32) once the state is large enough."""
BATCH = 8


def shape(state_bytes: int) -> tuple[int, int]:
    """(layers, width) whose parameters are a third of ``state_bytes`` (float32)."""
    params = state_bytes // 3
    if params >= 4 * LAYER_BYTES:
        return round(params / LAYER_BYTES), int(math.isqrt(LAYER_BYTES // 4))
    return 4, max(8, int(math.isqrt(params // 4 // 4)))


def state_bytes_of(layers: int, width: int) -> int:
    return 3 * layers * width * width * 4


def init_world(base: Path, phase: str, rank: int, world: int) -> None:
    store = dist.FileStore(str(base / f"init-{phase}"), world)
    store.set_timeout(timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def build(layers: int, width: int, world: int, seed: int) -> tuple[Any, torch.optim.Optimizer]:
    """The sharded model and its AdamW (no state until the first step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    stack = torch.nn.Sequential()
    for _ in range(layers):
        layer = torch.nn.Linear(width, width, bias=False)
        torch.nn.init.normal_(layer.weight, std=1 / math.sqrt(width))
        stack.append(fully_shard(layer, mesh=mesh))
    model = fully_shard(stack, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: Any, optimizer: torch.optim.Optimizer, width: int) -> None:
    """One optimizer step on a random batch (every rank the same one: the data don't matter)."""
    x = torch.randn(BATCH, width)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as the trainer: saves between steps hold no gradients
