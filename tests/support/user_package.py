"""A user's own task package, written where a test says: what docs/your-own-model.md has a
user write, kept outside this repository.

``write_user_package(root)`` writes ``mytask/`` (``mytask/model.py`` defines ``spec``: an MLP
whose hidden ``width`` shapes its parameters, the task's only state option, and a schedule
length that may change on a resume; the learning rate is the loop's own ``--lr``), reading its
samples from ``points.pt`` and ``nested/targets.pt`` under ``--data-dir``; a
``requirements.txt`` pinning one small package; and a ``.dockerignore`` that keeps the
repository's history, data and virtualenvs out of the image. It returns the directory to name
as ``taskPackage``.
"""

from __future__ import annotations

from pathlib import Path

REQUIREMENT = "tomli==2.2.1"
"""The one pinned package of the user's requirements (small, pure Python)."""

MODEL = '''"""A regression of y on 2-D points by an MLP: the user's own task."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from training.api import BuildContext, Data, MicroBatch, TrainParts, TrainSpec


@dataclass
class Options:
    width: int = 16
    """Hidden units of the MLP: the parameters' shapes."""
    total_steps: int = 1000
    """Length of the linear decay of the learning rate (may change on a resume)."""


class Points:
    """The samples: ``points.pt`` (N x 2) and ``nested/targets.pt`` (N)."""

    def __init__(self, data_dir: str) -> None:
        root = Path(data_dir)
        files = (root / "points.pt", root / "nested" / "targets.pt")
        self.x, self.y = (torch.load(f, weights_only=True) for f in files)
        self.digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]


def load_data(data_dir: str, options: Options) -> Data:
    return Data(train=Points(data_dir))


def build(options: Options, data: Data, run: BuildContext) -> TrainParts:
    model = nn.Sequential(nn.Linear(2, options.width), nn.Tanh(), nn.Linear(options.width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr)
    decay = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(0.0, 1.0 - step / options.total_steps)
    )
    return TrainParts(model, optimizer, decay)


def collate(items: Sequence[tuple[Tensor, Tensor]], where: MicroBatch) -> Any:
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def loss(model: nn.Module, batch: tuple[Tensor, Tensor], where: MicroBatch) -> Tensor:
    x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).sum()


spec = TrainSpec("mytask", Options, load_data, build, collate, loss, state_options=("width",))
'''

DOCKERIGNORE = """.git
.venv
data
**/__pycache__
"""


def write_user_package(root: Path) -> Path:
    """Write the package under ``root``; the directory to set as ``taskPackage``."""
    package = root / "my-repo"
    (package / "mytask").mkdir(parents=True, exist_ok=True)
    (package / "mytask" / "__init__.py").write_text("")
    (package / "mytask" / "model.py").write_text(MODEL)
    (package / "requirements.txt").write_text(f"{REQUIREMENT}\n")
    (package / ".dockerignore").write_text(DOCKERIGNORE)
    return package
