"""A task kept in the user's own package, outside ``training/``: written to a temporary
directory and put on ``sys.path`` (and PYTHONPATH, for a child process), as an image that
copies the user's package next to ``training/`` would hold it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

PACKAGE = "userpkg"
REFERENCE = f"{PACKAGE}.line:spec"
"""What ``--task`` names: the ``TrainSpec`` called ``spec`` in ``userpkg/line.py``."""

LINE_TASK = '''
"""A linear regression, written only against training.api."""

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.api import Data, TrainParts, TrainSpec


@dataclass
class LineOptions:
    width: int = 3
    """Inputs per sample."""


class Points:
    def __init__(self, count: int, width: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(count, width, generator=generator)
        self.y = self.x.sum(1, keepdim=True) + 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.x.numpy().tobytes()).hexdigest()


def load_data(data_dir, options):
    return Data(train=Points(32, options.width))


def build(options, data, run):
    model = nn.Linear(options.width, 1)
    return TrainParts(model, torch.optim.SGD(model.parameters(), lr=run.lr))


def collate(items, where):
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def loss(model, batch, where):
    x, y = batch
    return F.mse_loss(model(x), y, reduction="sum")


spec = TrainSpec("line", LineOptions, load_data, build, collate, loss)
not_a_spec = 42
'''


def write_user_package(root: Path) -> Path:
    """``root/userpkg/line.py``; returns ``root``, the directory to put on the path."""
    package = root / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "line.py").write_text(LINE_TASK)
    return root


@contextmanager
def user_package_on_path(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The user's package importable in this process, and forgotten afterwards."""
    monkeypatch.syspath_prepend(str(write_user_package(root)))
    try:
        yield root
    finally:
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]
