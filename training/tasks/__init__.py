"""The tasks this image trains, by name: one line each; and a task of the user's own module,
by reference (``my_package.my_module:spec``). docs/your-own-model.md is the guide.

The names are known without importing the tasks: a task imports torch, and what only needs the
names (``--help``, the lab's CLI, the stack's config) should not pay for it. A task's module is
imported on first use of its spec, a user's module too.
"""

from __future__ import annotations

import importlib
import re
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
SHARDABLE_TASKS = frozenset({"charlm"})
"""The built-in tasks whose spec has ``parallelize`` and ``init_weights`` (``--parallelism
fsdp2``), known without importing them: the stack's config refuses fsdp2 for the others at
preview, before any GPU node starts (tests/training/tasks/test_task_registry.py holds it to the
specs)."""
DEFAULT_TASK = "cifar"

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
TASK_REFERENCE = re.compile(rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*$")
"""``package.module:attribute``, as entry points name an object: a ``TrainSpec`` of the
user's own module."""
REFERENCE_FORM = "module.path:attribute"


class TaskImportError(ValueError):
    """A task reference whose module does not import, or whose object is not a TrainSpec."""


def is_task_reference(name: str) -> bool:
    """Whether ``name`` has the shape of a reference to a user's task (no import)."""
    return TASK_REFERENCE.match(name) is not None


def load_reference(reference: str) -> TrainSpec:
    """The ``TrainSpec`` that ``module.path:attribute`` names; TaskImportError saying what
    was found instead."""
    from training.api import TrainSpec  # torch, on first use only

    module_name, _, attribute = reference.partition(":")
    try:
        found: object = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error of its own, as a line
        raise TaskImportError(
            f"cannot import module {module_name!r}: {type(exc).__name__}: {exc} (is its package "
            "on PYTHONPATH, or in the image's /app?)"
        ) from exc
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise TaskImportError(f"module {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not isinstance(found, TrainSpec):
        raise TaskImportError(
            f"{reference} is a {type(found).__module__}.{type(found).__qualname__}, not a "
            "training.api.TrainSpec"
        )
    return found


class _Registry(Mapping[str, "TrainSpec"]):
    """The tasks by name, a module imported when its spec is first read; a reference
    (``module.path:attribute``) loads the user's spec. Iterates over the built-in names."""

    def __getitem__(self, name: str) -> TrainSpec:
        if name in _MODULES:
            spec: TrainSpec = importlib.import_module(_MODULES[name]).SPEC
            return spec
        if is_task_reference(name):
            return load_reference(name)
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in _MODULES or is_task_reference(name))

    def __iter__(self) -> Iterator[str]:
        return iter(_MODULES)

    def __len__(self) -> int:
        return len(_MODULES)


TASKS: Mapping[str, TrainSpec] = _Registry()
