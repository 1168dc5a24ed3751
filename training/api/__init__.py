"""The public API of elastic training: what a task imports, and all it imports of the loop.

A task is a ``TrainSpec`` (``training/api/spec.py``) in one file under ``training/tasks/``,
named in ``training/tasks/__init__.py``; docs/your-own-model.md is the guide.
"""

from training.api.extras import EMA, Extra
from training.api.keyed_random import keyed_dropout, keyed_seed, keyed_uniform
from training.api.spec import (
    BuildContext,
    Data,
    EvalContext,
    Evaluation,
    MicroBatch,
    ParallelContext,
    Samples,
    Stream,
    TaskContractError,
    TrainParts,
    TrainSpec,
    is_stream,
    require_at_least,
)

__all__ = [
    "BuildContext",
    "Data",
    "EMA",
    "EvalContext",
    "Evaluation",
    "Extra",
    "MicroBatch",
    "ParallelContext",
    "Samples",
    "Stream",
    "TaskContractError",
    "TrainParts",
    "TrainSpec",
    "keyed_dropout",
    "keyed_seed",
    "keyed_uniform",
    "is_stream",
    "require_at_least",
]
