"""Scenarios from TOML or JSON files, built-in names and ``--fault`` flags.

A file holds the ``Scenario`` fields at top level, a ``[train]`` table, an optional
``[rendezvous]`` table and ``[[faults]]`` entries. Unknown keys are errors, so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from lab.local.scenario import (
    FAULT_KINDS,
    Fault,
    Scenario,
    ScenarioError,
    TrainSettings,
    validate_scenario,
)
from training.elastic.launch import RendezvousSettings

SCENARIO_DIR = Path(__file__).parent / "scenarios"
BUILTIN_SCENARIOS = ("default", "ci", "charlm")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _parse(value: Any, kind: str) -> Any:
    """``value`` as ``kind`` (bool, int, float or str); ValueError when it is not one."""
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ValueError(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    # A table or list would reach int()/float() as a TypeError: reject it by type first.
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(value)
    if kind == "int":
        if isinstance(value, float) and not value.is_integer():  # 2.5, nan, inf
            raise ValueError(value)
        return int(value)
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(value)
    return number


_EXPECTED = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a finite number",
    "str": "a string",
}


def _convert(where: str, value: Any, annotation: str) -> Any:
    """``value`` as the field's type; strings (from flags) are parsed."""
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        if "None" in kinds:
            return None
        raise ScenarioError(f"{where}: a value is required")
    kind = next(k for k in kinds if k != "None")
    try:
        return _parse(value, kind)
    except (ValueError, OverflowError):
        raise ScenarioError(
            f"{where}: expected {kind}, got {value!r} (allowed: {_EXPECTED.get(kind, kind)})"
        ) from None


def _is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _build(cls: type, data: Any, where: str, skip: tuple[str, ...] = ()) -> Any:
    """An instance of dataclass ``cls`` from ``data``; unknown and missing keys are errors."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{where or 'scenario'}: expected a table, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    allowed = ", ".join(sorted(known))
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ScenarioError(
            f"{where or 'scenario'}: unknown key(s) {', '.join(unknown)}; allowed: {allowed}"
        )
    missing = [name for name, f in known.items() if _is_required(f) and name not in data]
    if missing:
        raise ScenarioError(
            f"{where or 'scenario'}: missing required key(s) {', '.join(missing)}; "
            f"allowed keys: {allowed}"
        )
    values = {
        name: _convert(f"{where}.{name}" if where else name, value, str(known[name].type))
        for name, value in data.items()
    }
    return cls(**values)


def _build_fault(data: Any, where: str) -> Fault:
    """A Fault; a missing ``kind`` is named together with the kinds there are."""
    if isinstance(data, dict) and "kind" not in data:
        raise ScenarioError(f"{where}.kind: required; allowed: {', '.join(FAULT_KINDS)}")
    return _build(Fault, data, where)


def scenario_from_dict(data: dict[str, Any], default_name: str) -> Scenario:
    """A validated Scenario from parsed TOML/JSON."""
    if not isinstance(data, dict):
        raise ScenarioError(f"scenario: expected a table of keys, got {type(data).__name__}")
    data = dict(data)
    train = _build(TrainSettings, data.pop("train", {}), "train")
    rendezvous = _build(RendezvousSettings, data.pop("rendezvous", {}), "rendezvous")
    faults_data = data.pop("faults", [])
    if not isinstance(faults_data, list):
        raise ScenarioError("faults: expected a list of tables ([[faults]])")
    faults = tuple(_build_fault(f, f"faults[{i}]") for i, f in enumerate(faults_data))
    data.setdefault("name", default_name)
    top = _build(Scenario, data, "", skip=("train", "rendezvous", "faults"))
    scenario = dataclasses.replace(top, train=train, rendezvous=rendezvous, faults=faults)
    validate_scenario(scenario)
    return scenario


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a ``.toml``/``.json`` file."""
    if name_or_path in BUILTIN_SCENARIOS:
        path = SCENARIO_DIR / f"{name_or_path}.toml"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ScenarioError(
                f"--scenario: {name_or_path!r} is neither a built-in scenario "
                f"({', '.join(BUILTIN_SCENARIOS)}) nor a file"
            )
    if path.suffix not in (".json", ".toml"):
        raise ScenarioError(f"--scenario: {path} must end in .toml or .json")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except OSError as err:
        raise ScenarioError(f"--scenario: cannot read {path}: {err.strerror or err}") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError and TOMLDecodeError too
        raise ScenarioError(f"--scenario: {path} does not parse: {err}") from None
    return scenario_from_dict(data, default_name=path.stem)


def parse_fault_flag(text: str) -> dict[str, str]:
    """``kind=kill,node=1,at_step=40`` as a dict (the same keys as a ``[[faults]]`` table)."""
    entries: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"--fault: expected key=value pairs, got {part!r} in {text!r}")
        entries[key.strip()] = value.strip()
    return entries


def _name_the_flags(message: str, *, nodes: bool, max_steps: bool, faults: bool) -> str:
    """A validation message about an overridden value, naming the flag that set it."""
    if max_steps:
        message = message.replace("train.max_steps", "--max-steps")
    if nodes and message.startswith("nodes:"):
        message = "--" + message
    if faults:
        message = message.replace("faults[", "--fault[")
    return message


def with_overrides(
    scenario: Scenario,
    *,
    nodes: int | None = None,
    max_steps: int | None = None,
    fault_flags: list[str] | None = None,
) -> Scenario:
    """The scenario with command-line overrides applied, validated again; an error about an
    overridden value names its flag (``--nodes``, ``--max-steps``, ``--fault[i]``)."""
    changed = scenario
    if nodes is not None:
        changed = dataclasses.replace(changed, nodes=nodes)
    if max_steps is not None:
        changed = dataclasses.replace(
            changed, train=dataclasses.replace(changed.train, max_steps=max_steps)
        )
    if fault_flags:
        faults = tuple(
            _build_fault(parse_fault_flag(text), f"--fault[{i}]")
            for i, text in enumerate(fault_flags)
        )
        changed = dataclasses.replace(changed, faults=faults)
    try:
        validate_scenario(changed)
    except ScenarioError as err:
        message = _name_the_flags(
            str(err),
            nodes=nodes is not None,
            max_steps=max_steps is not None,
            faults=bool(fault_flags),
        )
        raise ScenarioError(message) from None
    return changed
