"""Run the whole Pulumi program in-process under mocks: no CLI, no plugins, no cloud.

``run_program("dev")`` reads ``Pulumi.yaml`` defaults and ``Pulumi.dev.yaml`` values the way
the CLI would, applies overrides, runs ``__main__.py`` and returns every registered resource
and the settled stack outputs. Each call starts from fresh runtime state, so one pytest
session can run the program many times with different config.

The program is a function of its config, the mocked Azure's answers and the ``ARM_*``
environment (the deployer's sign-in), so ``run_program`` runs it once per such key in a
session and hands each caller its own copy; ``fresh=True`` runs it again, for the tests
that prove two runs agree.
"""

from __future__ import annotations

import copy
import os
import runpy
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc, settings
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from stack_config.files import stack_file_config
from tests.support.azure_answers import (
    AKS_SERVER_ID,
    SUBSCRIPTION_ID,
    TENANT_ID,
    AzureAnswers,
    fake_kubeconfig,
    fake_uuid,
    mock_id,
    mock_invoke,
    mock_state,
)

__all__ = [
    "AKS_SERVER_ID",
    "PROJECT_DIR",
    "SUBSCRIPTION_ID",
    "TENANT_ID",
    "AzureAnswers",
    "ProgramRun",
    "Registered",
    "fake_kubeconfig",
    "fake_uuid",
    "planned_changes",
    "run_program",
    "run_pulumi",
]

PROJECT_DIR = Path(__file__).resolve().parent.parent.parent


@dataclass
class Registered:
    """One resource the program registered (custom or component)."""

    type: str
    name: str
    inputs: dict[str, Any]
    """Inputs as the provider would receive them (camelCase keys, secrets unwrapped)."""
    outputs: dict[str, Any]
    """The state the mocks answered with (inputs plus plausible computed outputs)."""
    urn: str
    id: str | None
    custom: bool
    parent: str | None
    """URN of the parent resource (the stack's URN for top-level resources)."""
    provider: str | None
    """Provider reference (``urn::id``) when one was passed explicitly."""
    secret_inputs: set[str] = field(default_factory=set)
    """Dotted paths of inputs that were marked secret (e.g. ``kubeconfig``)."""
    dependencies: list[str] = field(default_factory=list)
    """URNs this resource depends on (explicit ``depends_on`` plus input dependencies)."""
    ignore_changes: list[str] = field(default_factory=list)
    replace_on_changes: list[str] = field(default_factory=list)
    delete_before_replace: bool = False
    custom_timeouts: dict[str, str] = field(default_factory=dict)
    """``create``/``update``/``delete`` timeouts the resource asked for (empty ones left out)."""
    renamed_from: list[tuple[str, bool]] = field(default_factory=list)
    """(old name, had no parent) of each alias that renames the resource."""

    @property
    def parent_type(self) -> str | None:
        """The parent's type token, read from its URN."""
        return _urn_type(self.parent) if self.parent else None

    @property
    def parent_name(self) -> str | None:
        """The parent's logical name, read from its URN."""
        return self.parent.rsplit("::", 1)[-1] if self.parent else None


@dataclass
class Invoked:
    """One invoke (function call) the program made."""

    token: str
    args: dict[str, Any]
    result: dict[str, Any]


@dataclass
class ProgramRun:
    """What one run of the program registered and exported."""

    resources: list[Registered]
    outputs: dict[str, Any]
    secret_outputs: set[str]
    """Names of stack outputs that are marked secret."""
    calls: list[Invoked]
    config: dict[str, str]
    """The exact config the program saw (namespaced keys, string values)."""
    project: str
    stack: str
    error: BaseException | None = None

    def of_type(self, type_: str) -> list[Registered]:
        """Every resource of one type token, in registration order."""
        return [r for r in self.resources if r.type == type_]

    def one(self, type_: str, name_contains: str | None = None) -> Registered:
        """The single resource of a type (optionally whose name contains a string)."""
        found = [r for r in self.of_type(type_) if name_contains is None or name_contains in r.name]
        if len(found) != 1:
            names = [r.name for r in self.of_type(type_)]
            raise AssertionError(
                f"expected one {type_} (name contains {name_contains!r}), found {len(found)}; "
                f"registered names of that type: {names}"
            )
        return found[0]

    def children_of(self, parent: Registered) -> list[Registered]:
        """Resources whose parent is ``parent``."""
        return [r for r in self.resources if r.parent == parent.urn]

    def calls_to(self, token: str) -> list[Invoked]:
        """Every invoke of one function token."""
        return [c for c in self.calls if c.token == token]

    def waits_for(self, resource: Registered, other: Registered) -> bool:
        """Whether ``resource`` is created after (and deleted before) ``other``: a dependency,
        direct or through other resources, or through its provider."""
        by_urn = {r.urn: r for r in self.resources}
        seen: set[str] = set()
        todo = [resource]
        while todo:
            current = todo.pop()
            edges = list(current.dependencies)
            if current.provider:  # "<provider urn>::<provider id>"
                edges.append(current.provider.rsplit("::", 1)[0])
            for urn in edges:
                if urn == other.urn:
                    return True
                if urn not in seen and urn in by_urn:
                    seen.add(urn)
                    todo.append(by_urn[urn])
        return False


class LabMocks(pulumi.runtime.Mocks):
    """Answers resources and invokes with plausible Azure/Kubernetes outputs."""

    def __init__(self, answers: AzureAnswers | None = None) -> None:
        self.calls: list[Invoked] = []
        self.answers = answers or AzureAnswers()

    @property
    def subscription_id(self) -> str:
        return self.answers.subscription_id

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict]:
        state = mock_state(args.typ, args.name, dict(args.inputs))
        return mock_id(args.typ, args.name, state, self.subscription_id), state

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict[str, Any]:
        result = mock_invoke(args.token, dict(args.args), self.answers)
        self.calls.append(Invoked(args.token, dict(args.args), result))
        return result


class RecordingMonitor(pulumi_mocks.MockMonitor):
    """The stock mock monitor, also recording parents, providers and options per resource."""

    def __init__(self, mocks: pulumi_mocks.Mocks) -> None:
        super().__init__(mocks)
        self.registered: list[Registered] = []

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        response = super().RegisterResource(request)
        if request.type == "pulumi:pulumi:Stack":
            return response
        state = self.resources[response.urn].state
        secret_paths: set[str] = set()
        inputs = unwrap_secrets(rpc.deserialize_properties(request.object), "", secret_paths)
        self.registered.append(
            Registered(
                type=request.type,
                name=request.name,
                inputs=inputs,
                outputs=dict(state),
                urn=response.urn,
                id=response.id or None,
                custom=bool(request.custom),
                parent=request.parent or None,
                provider=request.provider or None,
                secret_inputs=secret_paths,
                dependencies=list(request.dependencies),
                ignore_changes=list(request.ignoreChanges),
                replace_on_changes=list(request.replaceOnChanges),
                delete_before_replace=bool(request.deleteBeforeReplace),
                custom_timeouts={
                    key: value
                    for key in ("create", "update", "delete")
                    if (value := getattr(request.customTimeouts, key, ""))
                },
                renamed_from=[
                    (alias.spec.name, alias.spec.noParent)
                    for alias in request.aliases
                    if alias.spec.name
                ],
            )
        )
        return response


def planned_changes(before: Registered, after: Registered) -> list[str]:
    """The top-level inputs an ``up`` would change, from the state ``before`` left to the
    program's ``after``, with the engine's ``ignoreChanges``: "the engine simply replaces the
    values of input properties in the goal state with old inputs for properties marked as
    ignoreChanges" (pulumi/pulumi #2657); a property absent from the old inputs keeps the
    program's value (Pulumi docs, Resource option: ignoreChanges). An empty list: no update."""
    goal = dict(after.inputs)
    for key in after.ignore_changes:
        if key in before.inputs:
            goal[key] = before.inputs[key]
    keys = sorted(set(before.inputs) | set(goal))
    return [key for key in keys if before.inputs.get(key) != goal.get(key)]


def unwrap_secrets(value: Any, path: str, found: set[str]) -> Any:
    """``value`` with Pulumi's secret envelopes removed; adds each secret's dotted path to found."""
    if isinstance(value, dict):
        if value.get(rpc._special_sig_key) == rpc._special_secret_sig:
            found.add(path)
            return unwrap_secrets(value.get("value"), path, found)
        return {k: unwrap_secrets(v, f"{path}.{k}" if path else k, found) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap_secrets(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value


def _urn_type(urn: str) -> str:
    # urn:pulumi:<stack>::<project>::<parent$type chain>::<name>
    return urn.split("::")[2].rsplit("$", 1)[-1]


# ---- config the way the CLI assembles it: stack_config.files.stack_file_config ----------


# ---- running ---------------------------------------------------------------------------------


def run_pulumi(
    program: Callable[[], None],
    config: Mapping[str, str] | None = None,
    project: str = "spot-lab",
    stack: str = "dev",
    check: bool = True,
    answers: AzureAnswers | None = None,
) -> ProgramRun:
    """Run any program callable under fresh mocks and collect registrations and outputs.

    With ``check`` (the default) an exception from the program is re-raised; otherwise it
    is returned in ``ProgramRun.error`` next to whatever was registered before it.
    ``answers`` is what the mocked Azure says (subscription, deployer, existing pools).
    """
    mocks = LabMocks(answers)
    monitor = RecordingMonitor(mocks)
    # A fresh root Stack per run: set_mocks only creates one when none is installed.
    settings.set_root_resource(None)
    pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=False, monitor=monitor)
    pulumi.runtime.set_all_config(dict(config or {}), [])
    root = settings.get_root_resource()
    resolved: dict[str, Any] = {}
    secrets: set[str] = set()

    async def main() -> None:
        program()
        for key, value in dict(root.outputs).items():
            output = pulumi.Output.from_input(value)
            resolved[key] = await output.future()
            if await output.is_secret():
                secrets.add(key)

    error: BaseException | None = None
    try:
        _sync_await(run_pulumi_func(main))
    except Exception as exc:  # noqa: BLE001 handed to the caller, raised below when check
        error = exc
    finally:
        settings.set_root_resource(None)
    if error is not None and check:
        raise error
    return ProgramRun(
        resources=monitor.registered,
        outputs=resolved,
        secret_outputs=secrets,
        calls=mocks.calls,
        config=dict(config or {}),
        project=project,
        stack=stack,
        error=error,
    )


def run_program(
    stack: str = "dev",
    overrides: Mapping[str, str] | None = None,
    check: bool = True,
    project_dir: Path = PROJECT_DIR,
    stack_dir: Path | None = None,
    answers: AzureAnswers | None = None,
    fresh: bool = False,
) -> ProgramRun:
    """Run ``__main__.py`` for a stack file with optional config overrides (see ``run_pulumi``).

    ``stack_dir`` holds the stack file when it is not the project's (a modified copy).
    A run with the same key as an earlier one is that run's copy unless ``fresh``."""
    project, config = stack_file_config(stack, overrides, project_dir, stack_dir)
    key = _run_key(project_dir, stack, config, check, answers)
    if not fresh and key in _RUNS:
        return copy.deepcopy(_RUNS[key])
    main_file = project_dir / "__main__.py"
    if str(project_dir) not in sys.path:
        sys.path.insert(0, str(project_dir))

    def program() -> None:
        runpy.run_path(str(main_file), run_name="__main__")

    run = run_pulumi(program, config, project=project, stack=stack, check=check, answers=answers)
    _RUNS[key] = copy.deepcopy(run)
    return run


_RUNS: dict[tuple[object, ...], ProgramRun] = {}
"""This session's runs of the program, by ``_run_key``."""


def _run_key(
    project_dir: Path,
    stack: str,
    config: Mapping[str, str],
    check: bool,
    answers: AzureAnswers | None,
) -> tuple[object, ...]:
    # Everything the program reads: its config (the stack file's content, overrides applied),
    # the mocked Azure and the ARM_* sign-in (infra/catalog/deployer.py). The project's own
    # files do not change during a session.
    sign_in = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("ARM_")))
    return (
        str(project_dir),
        stack,
        tuple(sorted(config.items())),
        check,
        repr(answers or AzureAnswers()),
        sign_in,
    )
