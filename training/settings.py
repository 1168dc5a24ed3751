"""The settings the stack, the lab and the job share, in one torch-free module: the parallelisms
and precisions a run may choose, the task names, the rendezvous and its launch, and the data's
file conventions. The stack's config reads them here, never the trainer's flag module, and the
trainer's flags (``training/loop/config.py``) take their choices from here too."""

from __future__ import annotations

from training.data.sources import CHECKSUM, FORMATS, SOURCES, DataSource
from training.elastic.launch import (
    DEFAULT_TERMINATION_GRACE_S,
    LAUNCHERS,
    MEASURED_HEARTBEATS_PER_S,
    RDZV_BACKEND,
    RDZV_PORT,
    RendezvousSettings,
    termination_grace_problem,
)
from training.tasks import REFERENCE_FORM, SHARDABLE_TASKS, TASK_NAMES, is_task_reference

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
"""``--precision``: full fp32, or autocast to bf16 or fp16 (fp16 with a gradient scaler)."""
PARALLELISMS = ("ddp", "fsdp2")
"""``--parallelism``: every rank holds the whole model (DDP), or its shard of it (FSDP2)."""

__all__ = [
    "CHECKSUM",
    "DEFAULT_TERMINATION_GRACE_S",
    "FORMATS",
    "LAUNCHERS",
    "MEASURED_HEARTBEATS_PER_S",
    "PARALLELISMS",
    "PRECISIONS",
    "RDZV_BACKEND",
    "RDZV_PORT",
    "REFERENCE_FORM",
    "SHARDABLE_TASKS",
    "SOURCES",
    "TASK_NAMES",
    "DataSource",
    "RendezvousSettings",
    "is_task_reference",
    "termination_grace_problem",
]
