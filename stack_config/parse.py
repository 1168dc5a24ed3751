"""Raw key/value pairs (``Pulumi.yaml`` defaults, then the stack file) into a ``LabConfig``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from decimal import Decimal, InvalidOperation

from stack_config.fallback import with_join_timeout_default
from stack_config.keys import KEYS, REMOVED, SETTINGS, Setting
from stack_config.model import ConfigError, LabConfig

JOIN_TIMEOUT_KEY = "rdzvJoinTimeout"
"""Unset (absent or empty), the first round's join timeout follows the on-demand fallback."""


def _parse(setting: Setting, raw: str, project: str) -> object:
    """The typed value of one raw config string (spot price stays a float, version optional)."""
    key = f"{project}:{setting.key}"
    if setting.optional and not raw.strip():
        return None
    if setting.kind is int:
        try:
            return int(raw.strip())
        except ValueError:
            raise ConfigError([f"{key} must be an integer, got {raw!r}"]) from None
    if setting.kind is bool:
        return _parse_bool(raw, key)
    if setting.kind is dict:
        return _parse_object(raw, key)
    if setting.key == "spotMaxPrice":
        return _parse_spot_price(raw, key)
    if setting.key == "kubernetesVersion":
        return raw.strip() or None
    return raw.strip()


def _parse_bool(raw: str, key: str) -> bool:
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise ConfigError([f"{key} must be true or false, got {raw!r}"])
    return value == "true"


def _parse_object(raw: str, key: str) -> dict[str, object]:
    """A Pulumi object (the CLI hands it over as JSON) of flag names to single values."""
    allowed = (
        "a map of flag names to values, e.g. `pulumi config set --path trainArgs.lr 0.0004` "
        "or, in the stack file, trainArgs: {lr: 0.0004}"
    )
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise ConfigError([f"{key} must be {allowed}; got {raw!r}"]) from None
    if not isinstance(value, dict):
        raise ConfigError([f"{key} must be {allowed}; got {raw!r}"])
    nested = sorted(k for k, v in value.items() if isinstance(v, dict | list) or v is None)
    if nested:
        raise ConfigError(
            [f"{key}.{nested[0]} must be one value (a number, a string, true or false)"]
        )
    return dict(value)


def _parse_spot_price(raw: str, key: str) -> float:
    allowed = "-1 (pay up to the on-demand price) or a positive USD/hour, at most 5 decimals"
    try:
        price = Decimal(raw.strip())
    except InvalidOperation:
        raise ConfigError([f"{key} must be {allowed}, got {raw!r}"]) from None
    exponent = price.as_tuple().exponent
    decimals = -exponent if isinstance(exponent, int) and exponent < 0 else 0
    if not price.is_finite() or (price != -1 and (price <= 0 or decimals > 5)):
        raise ConfigError([f"{key} must be {allowed}, got {raw!r}"])
    return float(price)


def _with(obj: object, path: list[str], value: object) -> object:
    """A copy of a frozen dataclass tree with one nested field replaced."""
    if len(path) == 1:
        return replace(obj, **{path[0]: value})
    child = getattr(obj, path[0])
    return replace(obj, **{path[0]: _with(child, path[1:], value)})


def load(
    raw: Mapping[str, str], project: str, stack: str, location: str | None = None
) -> LabConfig:
    """Build a ``LabConfig`` from raw project config (keys without namespace, string values).

    Missing keys keep the dataclass defaults (equal to Pulumi.yaml's); an unset
    ``rdzvJoinTimeout`` follows the fallback (``with_join_timeout_default``). ``location`` is the
    ``azure-native:location`` value; when set it wins over the project's ``location`` key.
    Unknown keys and unparseable values raise ``ConfigError``, all problems at once.
    """
    by_key = {s.key: s for s in SETTINGS}
    problems = [
        f"{project}:{key} was removed: {REMOVED[key]}"
        if key in REMOVED
        else f"{project}:{key} is not a setting of this project; known keys: {', '.join(KEYS)}"
        for key in raw
        if key not in by_key
    ]
    cfg = LabConfig(project=project, stack=stack)
    for key, value in raw.items():
        if key == JOIN_TIMEOUT_KEY and not value.strip():
            continue  # unset: it follows the fallback, below

        if key not in by_key:
            continue
        try:
            cfg = _with(cfg, by_key[key].path.split("."), _parse(by_key[key], value, project))
        except ConfigError as err:
            problems.extend(err.problems)
    if not raw.get(JOIN_TIMEOUT_KEY, "").strip():
        cfg = with_join_timeout_default(cfg)
    if location:
        cfg = replace(cfg, location=location.strip())
    if problems:
        raise ConfigError(problems)
    return cfg


def config_values(cfg: LabConfig) -> dict[str, object]:
    """Each key's effective value (for logs and for checking Pulumi.yaml's defaults)."""
    values: dict[str, object] = {}
    for setting in SETTINGS:
        value: object = cfg
        for part in setting.path.split("."):
            value = getattr(value, part)
        values[setting.key] = value
    return values
