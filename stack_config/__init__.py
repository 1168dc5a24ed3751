"""The stack's configuration: one typed, validated object, read once in ``__main__.py``.

Defaults and descriptions live in ``Pulumi.yaml``; stack files override them. ``load()``
turns the raw key/value pairs into a frozen ``LabConfig`` and ``validate()`` checks every
rule before a single resource is registered. Both are pure: no pulumi import, no I/O.

- ``model``: the dataclasses;
- ``keys``: every config key and the field it fills;
- ``parse``: raw strings into a ``LabConfig``;
- ``validate``: the rules (``fallback``: the on-demand fallback's);
- ``task_package``: the user's package and task, read from disk (``task_source``) and resolved
  with ``trainArgs`` (``train_args``) into what the workers run.
"""

from stack_config.keys import KEYS, SETTINGS, Setting
from stack_config.model import (
    CIFAR10_CHECKSUM,
    CIFAR10_URL,
    NO_STAGING,
    TASKS,
    ClusterConfig,
    ConfigError,
    DataConfig,
    FallbackConfig,
    GpuPoolConfig,
    JobConfig,
    LabConfig,
    TrainingRun,
)
from stack_config.parse import config_values, load
from stack_config.validate import validate

__all__ = [
    "CIFAR10_CHECKSUM",
    "CIFAR10_URL",
    "KEYS",
    "NO_STAGING",
    "SETTINGS",
    "TASKS",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "FallbackConfig",
    "GpuPoolConfig",
    "JobConfig",
    "LabConfig",
    "Setting",
    "TrainingRun",
    "config_values",
    "load",
    "validate",
]
