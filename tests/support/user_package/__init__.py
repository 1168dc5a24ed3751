"""A user's own task package, as docs/your-own-model.md tells a user to write one: ``mytask/``
with its ``TrainSpec``, a ``requirements.txt`` pinning one small package and a
``.dockerignore``, written into a directory outside this repository. The training, export and
Pulumi tests share it; its source is the files beside this module, copied as they are."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

PACKAGE = "mytask"
REFERENCE = f"{PACKAGE}.model:spec"
"""What ``--task`` (and the stack's ``task``) names: the ``TrainSpec`` in ``mytask/model.py``."""
REQUIREMENT = "text-unidecode==1.3"
"""The one package the image installs for it (pure Python, small); the model never imports it,
so the tests run it without installing it."""
POINTS = "points.pt"
NESTED = "extra/scale.txt"
"""The data files ``load_data`` reads from ``--data-dir``: one at the root, one in a folder."""
_SOURCE = Path(__file__).parent / PACKAGE


def write_user_package(root: Path) -> Path:
    """``root/mytask/`` (``__init__.py``, ``model.py``), ``root/requirements.txt`` and
    ``root/.dockerignore``; returns ``root``, the directory to put on the import path."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(_SOURCE, root / PACKAGE, dirs_exist_ok=True, ignore=_no_cache)
    (root / "requirements.txt").write_text(f"{REQUIREMENT}\n")
    (root / ".dockerignore").write_text(".git\n**/__pycache__\ndata\n.venv\n")
    return root


def _no_cache(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__"]


def write_user_data(data_dir: Path, count: int = 64) -> Path:
    """The task's data in ``data_dir``: ``count`` points in ``points.pt`` and the targets' scale
    in ``extra/scale.txt``; returns ``data_dir``."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(count, 3, generator=generator, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    (data_dir / NESTED).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"x": x, "y": y}, data_dir / POINTS)
    (data_dir / NESTED).write_text("2.0\n")
    return data_dir
