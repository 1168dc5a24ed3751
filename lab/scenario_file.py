"""Scenarios from TOML or JSON files, built-in names and ``--fault`` flags.

A file holds the ``Scenario`` fields at top level, a ``[train]`` table, an optional
``[rendezvous]`` table and ``[[faults]]`` entries. Unknown keys are errors, so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

from lab.scenario import Fault, Scenario, ScenarioError, TrainSettings, validate_scenario
from training.launch import RendezvousSettings

SCENARIO_DIR = Path(__file__).parent / "scenarios"
BUILTIN_SCENARIOS = ("default", "ci")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _convert(where: str, value: Any, annotation: str) -> Any:
    """``value`` as the field's type; strings (from flags) are parsed."""
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        if "None" in kinds:
            return None
        raise ScenarioError(f"{where}: a value is required")
    kind = next(k for k in kinds if k != "None")
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            raise ValueError(value)
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        return str(value)
    except ValueError:
        raise ScenarioError(f"{where}: expected {kind}, got {value!r}") from None


def _build(cls: type, data: dict[str, Any], where: str, skip: tuple[str, ...] = ()) -> Any:
    """An instance of dataclass ``cls`` from ``data``; unknown keys are errors."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{where or 'scenario'}: expected a table, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    unknown = sorted(set(data) - set(known))
    if unknown:
        allowed = ", ".join(sorted(known))
        raise ScenarioError(
            f"{where or 'scenario'}: unknown key(s) {', '.join(unknown)}; allowed: {allowed}"
        )
    values = {
        name: _convert(f"{where}.{name}" if where else name, value, str(known[name].type))
        for name, value in data.items()
    }
    return cls(**values)


def scenario_from_dict(data: dict[str, Any], default_name: str) -> Scenario:
    """A validated Scenario from parsed TOML/JSON."""
    data = dict(data)
    train = _build(TrainSettings, data.pop("train", {}), "train")
    rendezvous = _build(RendezvousSettings, data.pop("rendezvous", {}), "rendezvous")
    faults_data = data.pop("faults", [])
    if not isinstance(faults_data, list):
        raise ScenarioError("faults: expected a list of tables ([[faults]])")
    faults = tuple(_build(Fault, f, f"faults[{i}]") for i, f in enumerate(faults_data))
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
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        elif path.suffix == ".toml":
            data = tomllib.loads(path.read_text())
        else:
            raise ScenarioError(f"--scenario: {path} must end in .toml or .json")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        raise ScenarioError(f"--scenario: {path} does not parse: {err}") from err
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


def with_overrides(
    scenario: Scenario,
    *,
    nodes: int | None = None,
    max_steps: int | None = None,
    fault_flags: list[str] | None = None,
) -> Scenario:
    """The scenario with command-line overrides applied, validated again."""
    changed = scenario
    if nodes is not None:
        changed = dataclasses.replace(changed, nodes=nodes)
    if max_steps is not None:
        changed = dataclasses.replace(
            changed, train=dataclasses.replace(changed.train, max_steps=max_steps)
        )
    if fault_flags:
        faults = tuple(
            _build(Fault, parse_fault_flag(text), f"--fault[{i}]")
            for i, text in enumerate(fault_flags)
        )
        changed = dataclasses.replace(changed, faults=faults)
    validate_scenario(changed)
    return changed
