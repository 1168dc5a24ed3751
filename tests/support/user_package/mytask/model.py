"""Points to a curve: a two-layer network written only against ``training.api``, with its data
read from ``--data-dir`` (``points.pt`` and ``extra/scale.txt``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from training.api import (
    BuildContext,
    Data,
    EvalContext,
    Evaluation,
    MicroBatch,
    ParallelContext,
    TrainParts,
    TrainSpec,
)


@dataclass
class MyOptions:
    width: int = 8
    """Hidden units: the shape of the model's parameters."""
    validation: int = 16
    """The last points, held out for the evaluation."""


class Points:
    """Indexable samples with a digest of their content, read from the data directory."""

    def __init__(self, x: Tensor, y: Tensor, digest: str) -> None:
        self.x, self.y, self._digest = x, y, digest

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]

    @property
    def digest(self) -> str:
        return self._digest


def load_data(data_dir: str, options: MyOptions) -> Data:
    """``points.pt`` (the points x and their targets y) and ``extra/scale.txt`` (the targets'
    scale) in ``data_dir``; the last ``--validation`` points are held out."""
    root = Path(data_dir)
    raw = (root / "points.pt").read_bytes()  # OSError: one line naming --data-dir
    points = torch.load(root / "points.pt", weights_only=True)
    scale = float((root / "extra" / "scale.txt").read_text())
    digest = hashlib.sha256(raw + str(scale).encode()).hexdigest()
    x, y = points["x"], points["y"] * scale
    cut = len(x) - options.validation
    return Data(
        train=Points(x[:cut], y[:cut], digest),
        validation=Points(x[cut:], y[cut:], digest),
    )


class PointsNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(3, width)
        self.out = nn.Linear(width, 1)
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def init_weights(model: nn.Module) -> None:
    for layer in (model.hidden, model.out):
        nn.init.normal_(layer.weight, std=0.5)
        nn.init.zeros_(layer.bias)


def parallelize(model: nn.Module, ctx: ParallelContext) -> None:
    fully_shard(model.hidden, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)


def build(options: MyOptions, data: Data, run: BuildContext) -> TrainParts:
    model = PointsNet(options.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr, momentum=0.9)
    return TrainParts(model, optimizer)


def collate(items: Sequence[tuple[Tensor, Tensor]], where: MicroBatch) -> tuple[Tensor, Tensor]:
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def loss(model: nn.Module, batch: tuple[Tensor, Tensor], where: MicroBatch) -> Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).sum()


def evaluate(model: nn.Module, data: Data, ctx: EvalContext) -> Evaluation:
    held_out = data.validation
    assert held_out is not None
    share = ctx.share(len(held_out))
    x, y = held_out.x[share.start : share.stop], held_out.y[share.start : share.stop]
    dtype = model.out.weight.dtype  # the run's --dtype
    errors = (model(x.to(ctx.device, dtype)) - y.to(ctx.device, dtype)) ** 2
    return Evaluation(loss_sum=float(errors.sum()), count=len(share))


spec = TrainSpec(
    name="mytask",
    options=MyOptions,
    load_data=load_data,
    build=build,
    collate=collate,
    loss=loss,
    evaluate=evaluate,
    parallelize=parallelize,
    init_weights=init_weights,
    state_options=("width",),
    defaults={"lr": 0.02},
)
