"""The tasks this image trains, by name: one line each. A new task is one module written
against ``training.api`` and one line here (docs/your-own-model.md)."""

from training.api import TrainSpec
from training.tasks import charlm, cifar

TASKS: dict[str, TrainSpec] = {
    cifar.SPEC.name: cifar.SPEC,
    charlm.SPEC.name: charlm.SPEC,
}
DEFAULT_TASK = cifar.SPEC.name
