"""The tasks this image trains, by name: one line each. A new task is one module written
against ``training.api`` and one line here (docs/your-own-model.md).

The names are known without importing the tasks: a task imports torch, and what only needs the
names (``--help``, the lab's CLI, the stack's config) should not pay for it. A task's module is
imported on first use of its spec.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.api import TrainSpec

_MODULES = {
    "charlm": "training.tasks.charlm",
    "cifar": "training.tasks.cifar",
}
"""Each task's name and its module, whose ``SPEC`` carries the same name."""

TASK_NAMES: tuple[str, ...] = tuple(sorted(_MODULES))
DEFAULT_TASK = "cifar"


class _Registry(Mapping[str, "TrainSpec"]):
    """The tasks by name; a task's module is imported when its spec is first read."""

    def __getitem__(self, name: str) -> TrainSpec:
        if name not in _MODULES:
            raise KeyError(name)
        spec: TrainSpec = importlib.import_module(_MODULES[name]).SPEC
        return spec

    def __iter__(self) -> Iterator[str]:
        return iter(_MODULES)

    def __len__(self) -> int:
        return len(_MODULES)


TASKS: Mapping[str, TrainSpec] = _Registry()
