"""Run the whole Pulumi program in-process under mocks: no CLI, no plugins, no cloud.

``run_program("dev")`` reads ``Pulumi.yaml`` defaults and ``Pulumi.dev.yaml`` values the way
the CLI would, applies overrides, runs ``__main__.py`` and returns every registered resource
and the settled stack outputs. Each call starts from fresh runtime state, so one pytest
session can run the program many times with different config.

The mocks answer with plausible state for each resource, ARM-shaped ids and the results of the
functions the program calls (its client config, the cluster's credentials and agent pools):
``AzureAnswers`` says what the world outside the program holds.

The program is a function of its config, the mocked Azure's answers and the ``ARM_*``
environment (the deployer's sign-in), so ``run_program`` runs it once per such key in a
session and hands each caller its own copy; ``fresh=True`` runs it again, for the tests
that prove two runs agree.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import os
import runpy
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import yaml
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc, settings
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from catalog.deployer import AZURE_CLI_APP_ID
from stack_config.files import stack_file_config

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


# ---- what the mocked Azure answers: plausible resource state, ids and invoke results ----

SUBSCRIPTION_ID = "00000000-0000-0000-0000-000000000000"
TENANT_ID = "11111111-1111-1111-1111-111111111111"


def fake_uuid(*parts: str) -> str:
    """A stable UUID for a mocked principal or client id, so runs are reproducible."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(parts)))


@dataclass(frozen=True)
class AzureAnswers:
    """What the mocked Azure says about the world outside the program."""

    subscription_id: str = SUBSCRIPTION_ID
    """The subscription the mocked provider deploys into (ids and getClientConfig)."""
    deployer_client_id: str = AZURE_CLI_APP_ID
    """getClientConfig's client id: the Azure CLI's own for a user (the default), else the
    signed-in principal's."""
    live_pool_counts: Mapping[str, int] = field(default_factory=dict)
    """Agent pools the cluster already has, with their current node counts (getManagedCluster)."""
    kept_inputs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Inputs the stack's state already holds, by resource name: for the properties a resource
    ignores (``ignoreChanges``) the engine answers with these instead of the program's ("the
    engine simply replaces the values of input properties in the goal state with old inputs",
    pulumi/pulumi #2657), so the program reads what an earlier ``up`` recorded."""


# ---- plausible provider answers -------------------------------------------------------------

# Input property that carries each Azure resource's physical name (else Pulumi auto-names it).
_AZURE_NAME_INPUTS = {
    "azure-native:resources:ResourceGroup": "resourceGroupName",
    "azure-native:containerservice:ManagedCluster": "resourceName",
    "azure-native:containerservice:AgentPool": "agentPoolName",
    "azure-native:storage:StorageAccount": "accountName",
    "azure-native:storage:BlobContainer": "containerName",
    "azure-native:containerregistry:Registry": "registryName",
    "azure-native:managedidentity:UserAssignedIdentity": "resourceName",
    "azure-native:managedidentity:FederatedIdentityCredential": (
        "federatedIdentityCredentialResourceName"
    ),
    "azure-native:authorization:RoleAssignment": "roleAssignmentName",
}


def _physical_name(type_: str, name: str, inputs: dict[str, Any]) -> str:
    key = _AZURE_NAME_INPUTS.get(type_)
    if key and inputs.get(key):
        return str(inputs[key])
    if type_ == "azure-native:authorization:RoleAssignment":
        return fake_uuid(type_, name)
    # Auto-naming appends a random suffix; a fixed one keeps runs reproducible.
    return f"{name}1a2b3c4"


def mock_state(type_: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The state a provider would return for a new resource: inputs plus computed outputs."""
    state = dict(inputs)
    if type_.startswith("azure-native:"):
        state["name"] = _physical_name(type_, name, inputs)
        state.update(_azure_outputs(type_, name, state))
    elif type_.startswith("kubernetes:") and isinstance(state.get("metadata"), dict):
        metadata = dict(state["metadata"])
        metadata.setdefault("name", f"{name}-1a2b3c4")
        metadata.setdefault("uid", fake_uuid(type_, name))
        state["metadata"] = metadata
    elif type_ == "command:local:Command":
        state.update({"stdout": "", "stderr": ""})
    return state


def _azure_outputs(type_: str, name: str, state: dict[str, Any]) -> dict[str, Any]:
    physical = state["name"]
    location = state.get("location", "westus3")
    if type_ == "azure-native:containerservice:ManagedCluster":
        rg = state.get("resourceGroupName", "rg")
        return {
            "nodeResourceGroup": state.get("nodeResourceGroup") or f"MC_{rg}_{physical}_{location}",
            "identityProfile": {
                "kubeletidentity": {
                    "clientId": fake_uuid(name, "kubelet", "client"),
                    "objectId": fake_uuid(name, "kubelet", "object"),
                }
            },
            "oidcIssuerProfile": {
                "enabled": True,
                "issuerURL": f"https://{location}.oic.prod-aks.azure.com/{TENANT_ID}/"
                f"{fake_uuid(name, 'oidc')}/",
            },
            "provisioningState": "Succeeded",
        }
    if type_ == "azure-native:storage:StorageAccount":
        return {"primaryEndpoints": {"blob": f"https://{physical}.blob.core.windows.net/"}}
    if type_ == "azure-native:containerregistry:Registry":
        return {"loginServer": f"{physical.lower()}.azurecr.io"}
    if type_ == "azure-native:managedidentity:UserAssignedIdentity":
        return {
            "clientId": fake_uuid(name, "client"),
            "principalId": fake_uuid(name, "principal"),
            "tenantId": TENANT_ID,
        }
    return {}


# Resource provider namespaces, for ARM-shaped ids.
_ARM_NAMESPACES = {
    "authorization": "Microsoft.Authorization",
    "containerregistry": "Microsoft.ContainerRegistry",
    "containerservice": "Microsoft.ContainerService",
    "managedidentity": "Microsoft.ManagedIdentity",
    "storage": "Microsoft.Storage",
}


def mock_id(
    type_: str, name: str, state: dict[str, Any], subscription_id: str = SUBSCRIPTION_ID
) -> str:
    """An ARM-shaped id for Azure resources, ``<name>-id`` for others."""
    if not type_.startswith("azure-native:"):
        return f"{name}-id"
    _, module, kind = type_.split(":")
    if kind == "ResourceGroup":
        return f"/subscriptions/{subscription_id}/resourceGroups/{state['name']}"
    rg = state.get("resourceGroupName", "rg")
    if kind == "BlobContainer":  # a child of the account's blob service, as ARM nests it
        return (
            f"/subscriptions/{subscription_id}/resourceGroups/{rg}/providers/Microsoft.Storage"
            f"/storageAccounts/{state['accountName']}/blobServices/default/containers/"
            f"{state['name']}"
        )
    if kind == "RoleAssignment":  # an extension resource: its id hangs off its scope
        return f"{state['scope']}/providers/Microsoft.Authorization/roleAssignments/{state['name']}"
    plural = kind[0].lower() + (f"{kind[1:-1]}ies" if kind.endswith("y") else f"{kind[1:]}s")
    namespace = _ARM_NAMESPACES.get(module, f"Microsoft.{module}")
    return (
        f"/subscriptions/{subscription_id}/resourceGroups/{rg}/providers/"
        f"{namespace}/{plural}/{state['name']}"
    )


# AKS's well-known Entra ID server (application) id, the same for every cluster.
AKS_SERVER_ID = "6dae42f8-4368-4678-94ff-3960e28e3630"


def fake_kubeconfig(cluster: str, fmt: str | None = None) -> str:
    """What listClusterUserCredential returns for a mocked cluster.

    ``format=exec`` on an Entra ID cluster gives the kubelogin plugin with a device-code login
    (the AKS API's ``format`` parameter); without it, a token stands in for the legacy forms.
    """
    if fmt == "exec":
        user: dict[str, Any] = {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1",
                "command": "kubelogin",
                "args": [
                    "get-token",
                    "--environment",
                    "AzurePublicCloud",
                    "--server-id",
                    AKS_SERVER_ID,
                    "--client-id",
                    "80faf920-1908-4b52-b5ef-a8e7bedfc67a",
                    "--tenant-id",
                    TENANT_ID,
                    "--login",
                    "devicecode",
                ],
                "installHint": "kubelogin is not installed",
            }
        }
    else:
        user = {"token": "mock-token"}
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster, "cluster": {"server": f"https://{cluster}.mock:443"}}],
            "users": [{"name": f"clusterUser_{cluster}", "user": user}],
            "contexts": [
                {"name": cluster, "context": {"cluster": cluster, "user": f"clusterUser_{cluster}"}}
            ],
            "current-context": cluster,
        }
    )


def mock_invoke(
    token: str, args: dict[str, Any], answers: AzureAnswers | None = None
) -> dict[str, Any]:
    """Answers for the functions (invokes) the program may call; unknown ones return ``{}``."""
    answers = answers or AzureAnswers()
    if token in (
        "azure-native:containerservice:listManagedClusterUserCredentials",
        "azure-native:containerservice:listManagedClusterAdminCredentials",
    ):
        kubeconfig = fake_kubeconfig(str(args.get("resourceName", "cluster")), args.get("format"))
        value = base64.b64encode(kubeconfig.encode()).decode()
        return {"kubeconfigs": [{"name": "clusterUser", "value": value}]}
    if token == "azure-native:authorization:getClientConfig":
        return {
            "clientId": answers.deployer_client_id,
            "objectId": fake_uuid("deployer", "object"),
            "subscriptionId": answers.subscription_id,
            "tenantId": TENANT_ID,
        }
    if token == "azure-native:containerservice:getManagedCluster":
        pools = [{"name": "bootstrap", "count": 1, "mode": "System"}]
        pools += [{"name": n, "count": c} for n, c in answers.live_pool_counts.items()]
        return {"name": args.get("resourceName"), "agentPoolProfiles": pools}
    return {}


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
    retain_on_delete: bool = False
    """``pulumi destroy`` leaves it in the cloud (Pulumi's ``retainOnDelete``)."""
    custom_timeouts: dict[str, str] = field(default_factory=dict)
    """``create``/``update``/``delete`` timeouts the resource asked for (empty ones left out)."""
    renamed_from: list[tuple[str, bool]] = field(default_factory=list)
    """(old name, had no parent) of each alias that renames the resource."""
    engine_urn: str = ""
    """The URN the Pulumi engine gives it: its parents' whole chain of types below the stack
    (the mock monitor's ``urn`` keeps only the parent's own type)."""
    alias_urns: list[str] = field(default_factory=list)
    """The engine URNs its aliases name: a resource of a stack at one of these is this one."""

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
        self.ignored: dict[str, list[str]] = {}
        """Each resource's ``ignoreChanges``, as the monitor saw it registered."""

    @property
    def subscription_id(self) -> str:
        return self.answers.subscription_id

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict]:
        kept = self.answers.kept_inputs.get(args.name, {})
        ignored = self.ignored.get(args.name, [])
        inputs = dict(args.inputs) | {k: v for k, v in kept.items() if k in ignored}
        state = mock_state(args.typ, args.name, inputs)
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
        self._engine_types: dict[str, str] = {}
        """The engine's qualified type by mock URN (the stack's is empty: it is left out)."""
        self._by_mock_type: dict[str, str | None] = {}
        """The engine's qualified type by the mock's (None where two differ)."""

    def _engine_type(self, parent_type: str, type_: str) -> str:
        return f"{parent_type}${type_}" if parent_type else type_

    def _engine_type_of(self, urn: str) -> str:
        """The engine's qualified type of a URN: a registered resource's, or one that
        ``pulumi.resource.create_urn`` built under a registered parent (an alias's old parent)."""
        if urn in self._engine_types:
            return self._engine_types[urn]
        head, _, type_ = urn.split("::")[2].rpartition("$")
        parent_type = self._by_mock_type.get(head)
        if parent_type is None:
            raise AssertionError(f"no single registered parent of type chain {head!r} for {urn}")
        return self._engine_type(parent_type, type_)

    def _alias_urns(self, request: Any, engine_type: str, prefix: str) -> list[str]:
        urns = []
        for alias in request.aliases:
            if alias.urn:
                urns.append(alias.urn)
                continue
            spec = alias.spec
            if spec.noParent:
                parent_type = ""
            else:
                parent_type = self._engine_type_of(spec.parentUrn or request.parent)
            type_ = self._engine_type(parent_type, spec.type or request.type)
            urns.append(f"{prefix}::{type_}::{spec.name or request.name}")
        return urns

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        self.mocks.ignored[request.name] = list(request.ignoreChanges)
        response = super().RegisterResource(request)
        mock_type = response.urn.split("::")[2]
        if request.type == "pulumi:pulumi:Stack":
            self._engine_types[response.urn] = ""
            self._by_mock_type[mock_type] = ""
            return response
        engine_type = self._engine_type(self._engine_types.get(request.parent, ""), request.type)
        self._engine_types[response.urn] = engine_type
        known = self._by_mock_type.setdefault(mock_type, engine_type)
        if known != engine_type:
            self._by_mock_type[mock_type] = None
        prefix = "::".join(response.urn.split("::")[:2])  # urn:pulumi:<stack>::<project>
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
                retain_on_delete=bool(request.retainOnDelete),
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
                engine_urn=f"{prefix}::{engine_type}::{request.name}",
                alias_urns=self._alias_urns(request, engine_type, prefix),
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
        _drain()
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


def _drain() -> None:
    """Forget what a failed run left behind: the SDK raises the first exception of an
    ``apply`` and keeps the Outputs that await it in ``SETTINGS.outputs``, which ``set_mocks``
    does not reset; the next run would await them and take their error for its own."""
    loop = asyncio.get_event_loop()
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if pending:
        _sync_await(asyncio.gather(*pending, return_exceptions=True))
    settings.SETTINGS.outputs = set()


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
    # the mocked Azure and the ARM_* sign-in (catalog/deployer.py). The project's own
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
