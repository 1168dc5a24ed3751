"""A stack config loaded and validated from raw overrides of the defaults, and the problem an
invalid one is refused with."""

from __future__ import annotations

import pytest

from stack_config import ConfigError, LabConfig, load, validate


def _cfg(raw: dict[str, str] | None = None, location: str | None = None) -> LabConfig:
    """A loaded and validated config from raw overrides of the defaults."""
    cfg = load(raw or {}, "spot-lab", "dev", location)
    validate(cfg)
    return cfg


def _problems(raw: dict[str, str]) -> str:
    """The ConfigError message for raw config that must fail load or validate."""
    with pytest.raises(ConfigError) as info:
        _cfg(raw)
    return str(info.value)
