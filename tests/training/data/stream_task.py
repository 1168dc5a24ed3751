"""A task that streams its data: a small regression read in order from JSON-lines shards named
by a manifest (training/data/streams.py), referenced as ``--task`` ``REFERENCE``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.api import Data, MicroBatch, TrainParts, TrainSpec
from training.data.streams import open_stream, write_stream

REFERENCE = "tests.training.data.stream_task:SPEC"
WIDTH = 3


@dataclass
class PointsOptions:
    hidden: int = 8
    """Units of the hidden layer."""


def write_points(root: Path, count: int, shard_size: int = 50, version: str = "1") -> None:
    """``count`` points (x, y) of a fixed curve, in shards of ``shard_size``."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(count, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * x[:, :1]
    rows = torch.cat([x, y], 1).tolist()
    write_stream(
        root, "points", version, [rows[i : i + shard_size] for i in range(0, count, shard_size)]
    )


def load_data(data_dir: str, options: PointsOptions) -> Data:
    return Data(train=open_stream(data_dir))


def build(options: PointsOptions, data: Data, run: Any) -> TrainParts:
    model = nn.Sequential(nn.Linear(WIDTH, options.hidden), nn.Tanh(), nn.Linear(options.hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr, momentum=0.9)
    return TrainParts(model, optimizer)


def collate(items: Sequence[list[float]], where: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.tensor(items, dtype=torch.float64)
    return rows[:, :WIDTH], rows[:, WIDTH:]


def loss(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], where: MicroBatch
) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).sum()


SPEC = TrainSpec(
    name="points",
    options=PointsOptions,
    load_data=load_data,
    build=build,
    collate=collate,
    loss=loss,
    defaults={"lr": 0.05},
)
