"""CIFAR-10 image classification: a small GroupNorm ResNet, SGD with momentum, augmentation keyed
by (seed, epoch, sample index). Written only against ``training.api``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.api import (
    BuildContext,
    Data,
    MicroBatch,
    TrainParts,
    TrainSpec,
    require_at_least,
)
from training.data.cifar10 import load_cifar10_binary, normalised_batch
from training.tasks.resnet import ModelConfig, build_model

DROPOUT_STREAM = 1


@dataclass
class CifarOptions:
    model_width: int = 16
    """Channels of the first ResNet stage (the others are 2x and 4x)."""
    model_blocks: int = 2
    """Residual blocks per stage."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 5e-4
    """L2 weight decay."""
    dropout: float = 0.0
    """Dropout before the classifier (0 = off), each sample's mask keyed by its seed."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warmup to --lr (0 = none)."""


def check(options: CifarOptions) -> None:
    require_at_least(options, 1, "model_width", "model_blocks")
    require_at_least(options, 0, "warmup_steps")
    if not 0.0 <= options.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {options.dropout}")


def load_data(data_dir: str, options: CifarOptions) -> Data:
    """The binary CIFAR-10 training batches in ``data_dir`` (``data_batch_N.bin``)."""
    return Data(train=load_cifar10_binary(data_dir))


def build(options: CifarOptions, data: Data, run: BuildContext) -> TrainParts:
    shape = ModelConfig(options.model_width, options.model_blocks, dropout=options.dropout)
    model = build_model(shape)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=run.lr, momentum=options.momentum, weight_decay=options.weight_decay
    )
    scheduler = None
    if options.warmup_steps:
        warmup = options.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min((step + 1) / warmup, 1.0)
        )
    return TrainParts(model, optimizer, scheduler)


def collate(items: Sequence[tuple[torch.Tensor, torch.Tensor]], where: MicroBatch) -> Any:
    images = torch.stack([image for image, _ in items])
    labels = torch.stack([label for _, label in items])
    return normalised_batch(images, labels, where.indices, where.seed, where.epoch)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], where: MicroBatch) -> Any:
    images, labels = batch
    return F.cross_entropy(
        model(images, where.sample_seeds(DROPOUT_STREAM)), labels, reduction="sum"
    )


SPEC = TrainSpec(
    name="cifar",
    options=CifarOptions,
    load_data=load_data,
    build=build,
    collate=collate,
    loss=loss,
    check=check,
    state_options=("model_width", "model_blocks"),  # the parameters' shapes
)
