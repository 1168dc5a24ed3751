"""The stack's config as the Pulumi CLI assembles it: ``Pulumi.yaml`` defaults, then the stack file.

``pulumi up`` gets these values from the CLI; the lab's tools (``lab preflight``, ``lab
prices``) and the tests read the same files here, so a stack is read one way everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stack_config.model import ConfigError, LabConfig
from stack_config.parse import load
from stack_config.task_package import resolve
from stack_config.validate import validate

PROJECT_DIR = Path(__file__).resolve().parent.parent


def _config_string(value: Any) -> str:
    """A config value the way ``pulumi.Config`` hands it over: a string, objects as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def stack_names(project_dir: Path = PROJECT_DIR) -> list[str]:
    """The stacks that have a ``Pulumi.<stack>.yaml`` in the project."""
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in project_dir.glob("Pulumi.*.yaml"))


def stack_file_config(
    stack: str,
    overrides: Mapping[str, str] | None = None,
    project_dir: Path = PROJECT_DIR,
    stack_dir: Path | None = None,
) -> tuple[str, dict[str, str]]:
    """(project name, config) from Pulumi.yaml defaults, Pulumi.<stack>.yaml, then overrides.

    Keys are namespaced (``spot-lab:gpuMaxNodes``); an override key without a namespace is
    taken as the project's. Values are strings, objects JSON, as ``pulumi.Config`` expects.
    Like the CLI, a project key that Pulumi.yaml does not declare is an error. Encrypted
    values of other namespaces (a provider's client secret) are left out: nothing here
    needs them, and only the CLI holds the key. The stack file is read from ``stack_dir``
    when given (the CLI's ``stackConfigDir``), else from the project.
    """
    project_file = yaml.safe_load((project_dir / "Pulumi.yaml").read_text())
    project = project_file["name"]
    config: dict[str, str] = {}
    for key, spec in (project_file.get("config") or {}).items():
        full = key if ":" in key else f"{project}:{key}"
        if isinstance(spec, dict) and ("default" in spec or "value" in spec):
            config[full] = _config_string(spec.get("default", spec.get("value")))
    declared = set(config)
    name = stack.split("/")[-1]  # org/project/stack names the same file as stack
    stack_file = (stack_dir or project_dir) / f"Pulumi.{name}.yaml"
    if not stack_file.exists():
        known = ", ".join(stack_names(stack_dir or project_dir)) or "none"
        raise ConfigError(
            [f"no stack file {stack_file.name} in {stack_file.parent} (stacks here: {known})"]
        )
    try:
        values = dict((yaml.safe_load(stack_file.read_text()) or {}).get("config") or {})
    except (yaml.YAMLError, AttributeError) as err:
        raise ConfigError([f"{stack_file.name} is not a Pulumi stack file: {err}"]) from None
    values.update({k if ":" in k else f"{project}:{k}": v for k, v in (overrides or {}).items()})
    problems = []
    for key, value in values.items():
        ours = key.startswith(f"{project}:")
        if ours and key not in declared:
            problems.append(f"{key} is not declared in Pulumi.yaml (the CLI rejects it too)")
        elif isinstance(value, dict) and "secure" in value:
            if ours:
                problems.append(f"{stack_file.name}: {key} is encrypted; no setting is a secret")
        else:
            config[key] = _config_string(value)
    if problems:
        raise ConfigError(problems)
    return project, config


@dataclass(frozen=True)
class StackSettings:
    """A stack's validated config and the provider settings ``pulumi up`` would use."""

    config: LabConfig
    subscription_id: str | None
    """``azure-native:subscriptionId`` of the stack file, when set."""
    provider: dict[str, str]
    """The stack's ``azure-native:*`` values, without the namespace."""
    warnings: tuple[str, ...] = ()
    """What ``pulumi up`` would warn about the task package (``task_package.resolve``)."""


def load_stack(stack: str, project_dir: Path = PROJECT_DIR) -> StackSettings:
    """Load and validate a stack's config exactly as ``__main__.read_config`` does.

    Raises ``ConfigError`` with the same messages ``pulumi up`` would show.
    """
    project, values = stack_file_config(stack, project_dir=project_dir)
    prefix = f"{project}:"
    raw = {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}
    provider = {
        k[len("azure-native:") :]: v for k, v in values.items() if k.startswith("azure-native:")
    }
    cfg = load(raw, project, stack.split("/")[-1], provider.get("location"))
    validate(cfg)
    cfg, warnings = resolve(cfg, project_dir)
    return StackSettings(cfg, provider.get("subscriptionId") or None, provider, tuple(warnings))
