"""A small ResNet for 32x32 images, in plain PyTorch, whose output for a sample never
depends on the other samples in its batch.

GroupNorm instead of BatchNorm: batch statistics would come from each rank's micro-batch,
whose size changes with the world size, and so would the trajectory. The optional dropout
before the head draws each sample's mask from that sample's own seed (``keyed_dropout``), not
from a per-rank RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from training.api import keyed_dropout

STAGES = 3
"""Stages of widths w, 2w, 4w; each later stage halves the resolution (32, 16, 8)."""
MAX_GROUPS = 8


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the network."""

    width: int = 16
    """Channels of the first stage; the next stages have 2x and 4x."""
    blocks_per_stage: int = 2
    """BasicBlocks per stage (2 gives a ResNet-14-like depth)."""
    num_classes: int = 10
    """Outputs of the linear head."""
    dropout: float = 0.0
    """Dropout before the head (0 = off)."""

    def validate(self) -> None:
        """Raise ValueError naming the field when a size is out of range."""
        for name, least in (("width", 1), ("blocks_per_stage", 1), ("num_classes", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"model {name} must be an integer >= {least}, got {value!r}")


def _norm(channels: int) -> nn.GroupNorm:
    # Up to 8 groups that divide the channels; per-sample statistics, whatever the batch.
    return nn.GroupNorm(math.gcd(channels, MAX_GROUPS), channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al., 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.norm1 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.norm2 = _norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), _norm(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, three stages of BasicBlocks, global average pool, linear head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, cfg.width, 3, 1, padding=1, bias=False), _norm(cfg.width), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        in_channels = cfg.width
        for stage in range(STAGES):
            out_channels = cfg.width * 2**stage
            for block in range(cfg.blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
        self.stages = nn.Sequential(*blocks)
        self.head = nn.Linear(in_channels, cfg.num_classes)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; ``seeds`` (one per sample, in training) turn the dropout on."""
        features = self.stages(self.stem(x)).mean(dim=(2, 3))
        if seeds is not None:
            features = keyed_dropout(features, self.dropout, seeds, site=0)
        return self.head(features)


def _initialise(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.GroupNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    # Each block starts as the identity (Goyal et al., 2017): stable early steps at any depth.
    for module in model.modules():
        if isinstance(module, BasicBlock):
            nn.init.zeros_(module.norm2.weight)


def build_model(cfg: ModelConfig) -> nn.Module:
    """The network for ``cfg``; its initial weights come from torch's global RNG only."""
    cfg.validate()
    model = ResNet(cfg)
    _initialise(model)
    return model


def parameter_count(model: nn.Module) -> int:
    """Number of scalar parameters in ``model``."""
    return sum(p.numel() for p in model.parameters())
