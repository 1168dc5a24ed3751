"""``python -m lab preflight``: will ``pulumi up`` work, before it creates and bills anything?

Reads the stack exactly as ``pulumi up`` does, then checks the machine (tools, logins) and
the subscription (providers, VM sizes, quotas, permissions, ACR Tasks). It only reads: every
Azure call is a GET, every local tool is asked for its version or its account.

Exit 0: ``pulumi up`` can go ahead (warnings allowed). 1: a check fails. 2: bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.cluster import BOOTSTRAP_VM_SIZE
from lab.azure.clients import (
    ARM,
    Azure,
    AzureError,
    NotSignedIn,
    Refused,
    Unreachable,
    azure_errors,
    signed_in_as,
)
from lab.azure.stack_choice import resolve_stack
from lab.exit_status import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from stack_config.files import PROJECT_DIR, StackSettings
from stack_config.model import ConfigError, LabConfig

OK, WARNING, FAILS, SKIPPED = "ok", "warning", "fails", "skipped"

# Resource providers of what the stack creates: AKS (and the VMs, load balancer and disks it
# creates in its node resource group), storage, the registry, the managed identities.
PROVIDERS = (
    "Microsoft.ContainerService",
    "Microsoft.Compute",
    "Microsoft.Network",
    "Microsoft.Storage",
    "Microsoft.ContainerRegistry",
    "Microsoft.ManagedIdentity",
)
# What ``pulumi up`` needs at subscription scope: a new resource group, and role assignments
# for the identities and for the deployer (infra/roles.py).
ROLE_ASSIGNMENT_WRITE = "Microsoft.Authorization/roleAssignments/write"
RESOURCE_GROUP_WRITE = "Microsoft.Resources/subscriptions/resourceGroups/write"
# ACR Tasks runs are paused for subscriptions on Azure free credits: `az acr build` fails
# with TasksOperationsNotAllowed (ACR Tasks overview on learn.microsoft.com; Azure/acr and
# azure-search-openai-demo#2592 show the error). Offer ids are the subscription's quotaId.
NO_ACR_TASKS = ("FreeTrial_", "AzureForStudents_", "AzurePass_")
CREDIT_OFFERS = ("MSDN_", "MSDNDevTest_", "Sponsored_", "BizSpark", "AzureInOpen_")
QUOTA_PAGE = "https://portal.azure.com/#view/Microsoft_Azure_Capacity/QuotaMenuBlade/~/myQuotas"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str
    detail: str
    fix: str = ""


Runner = Callable[[list[str]], subprocess.CompletedProcess[str]]


def run_tool(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a local tool with a time limit; a hung tool reads as a failed one."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]} did not answer in 60 s")
    except OSError as err:
        return subprocess.CompletedProcess(argv, 127, "", str(err))


@dataclass
class Context:
    """What the checks share: the stack, Azure, the tools' answers found so far."""

    settings: StackSettings
    azure: Azure
    run: Runner = run_tool
    az_account: dict[str, Any] | None = None
    """``az account show``: az's signed-in account and default subscription."""
    subscription: str | None = None
    subscription_source: str = ""
    offer: str | None = None
    """The subscription's quotaId (its offer)."""
    caller: dict[str, Any] = field(default_factory=dict)
    skus: dict[str, Any] = field(default_factory=dict)
    """The needed VM sizes' Resource SKU entries, by lower-case name."""

    @property
    def cfg(self) -> LabConfig:
        return self.settings.config

    @property
    def environ(self) -> Mapping[str, str]:
        """The environment ``pulumi up`` would see (sign-in and subscription variables)."""
        return self.azure.environ


# ---- on this machine ------------------------------------------------------------------------


def _version(ctx: Context, argv: list[str]) -> tuple[bool, str]:
    done = ctx.run(argv)
    lines = [line.strip() for line in (done.stdout or done.stderr).splitlines() if line.strip()]
    # The first line with a digit: kubelogin prints a title line before its version.
    version = next((line for line in lines if any(c.isdigit() for c in line)), "")
    return done.returncode == 0, version or (lines[0] if lines else "")


def check_tools(ctx: Context) -> Iterator[Check]:
    """The tools ``pulumi up`` runs, and az's login."""
    tools: list[tuple[str, list[str], str, str]] = [
        ("pulumi", ["pulumi", "version"], FAILS, "https://www.pulumi.com/docs/install/"),
        ("git", ["git", "--version"], FAILS, "install git (kustomize fetches the operator)"),
        ("kubelogin", ["kubelogin", "--version"], FAILS, "az aks install-cli"),
        ("kubectl", ["kubectl", "version", "--client"], WARNING, "az aks install-cli"),
    ]
    if ctx.cfg.image_builder == "docker":
        docker = ["docker", "version", "--format", "{{.Server.Version}}"]
        tools.append(("docker", docker, FAILS, "start Docker, or set imageBuilder acr"))
    for name, argv, severity, fix in tools:
        if shutil.which(argv[0], path=ctx.environ.get("PATH")) is None:
            yield Check(f"tool {name}", severity, "not found on PATH", fix)
            continue
        ok, version = _version(ctx, argv)
        if ok:
            yield Check(f"tool {name}", OK, version)
        else:
            yield Check(f"tool {name}", severity, f"`{' '.join(argv)}` failed: {version}", fix)
    yield from check_az(ctx)


def check_az(ctx: Context) -> Iterator[Check]:
    """``az`` builds the image (ACR Tasks or ``az acr login``), so it must be signed in."""
    if shutil.which("az", path=ctx.environ.get("PATH")) is None:
        yield Check("tool az", FAILS, "not found on PATH", "https://aka.ms/installazurecli")
        return
    ok, version = _version(ctx, ["az", "version", "--query", '"azure-cli"', "--output", "tsv"])
    done = ctx.run(["az", "account", "show", "--output", "json"])
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no account"])[-1]
        yield Check("tool az", FAILS, f"{version or 'az'}, not signed in: {reason}", "az login")
        return
    try:
        ctx.az_account = json.loads(done.stdout)
    except ValueError:
        yield Check("tool az", FAILS, "`az account show` did not print JSON", "az login")
        return
    user = (ctx.az_account or {}).get("user", {}).get("name", "?")
    yield Check("tool az", OK, f"{version or 'az'}, signed in as {user}")


def choose_subscription(ctx: Context) -> None:
    """The subscription pulumi-azure-native deploys into, and where that comes from."""
    if ctx.settings.subscription_id:
        ctx.subscription, ctx.subscription_source = ctx.settings.subscription_id, "stack config"
    elif ctx.environ.get("ARM_SUBSCRIPTION_ID"):
        ctx.subscription = ctx.environ["ARM_SUBSCRIPTION_ID"]
        ctx.subscription_source = "ARM_SUBSCRIPTION_ID"
    elif ctx.az_account:
        ctx.subscription, ctx.subscription_source = ctx.az_account.get("id"), "az's default"


# ---- in the subscription --------------------------------------------------------------------


def check_sign_in(ctx: Context) -> Iterator[Check]:
    ctx.azure.probe(ARM)
    ctx.caller = ctx.azure.caller()
    who = ctx.caller.get("upn") or ctx.caller.get("unique_name") or ctx.caller.get("appid", "?")
    how = signed_in_as(ctx.environ)
    yield Check("sign-in", OK, f"{who} (object id {ctx.caller.get('oid', '?')}) via {how}")


def check_subscription(ctx: Context) -> Iterator[Check]:
    sub = ctx.subscription
    if not sub:
        fix = "az login, or pulumi config set azure-native:subscriptionId <id>"
        yield Check("subscription", FAILS, "no subscription configured and no az default", fix)
        return
    with ctx.azure.subscriptions() as client:
        found = client.subscriptions.get(sub)
    ctx.offer = found.subscription_policies.quota_id if found.subscription_policies else None
    detail = f"{found.display_name} ({sub}), from {ctx.subscription_source}"
    enable = "use an enabled subscription (azure-native:subscriptionId)"
    # Warned: past due or at a spending limit; its resources still run and can be created.
    if found.state not in ("Enabled", "Warned"):
        yield Check("subscription", FAILS, f"{detail} is {_text(found.state)}", enable)
        return
    status, fix = (OK, "") if found.state == "Enabled" else (WARNING, enable)
    if found.state != "Enabled":
        detail += f", {_text(found.state)}"
    az_default = (ctx.az_account or {}).get("id")
    if az_default is None or az_default.lower() == sub.lower():
        also = ", az's default too" if az_default else ""
        yield Check("subscription", status, detail + also, fix)
        return
    # The image build passes --subscription, so az only has to be able to reach it.
    done = ctx.run(["az", "account", "show", "--subscription", sub, "--output", "json"])
    if done.returncode != 0:
        fix = f"az login with an account of {sub}, then az account set --subscription {sub}"
        why = f"{detail}; az cannot use it, and the image build runs az"
        yield Check("subscription", FAILS, why, fix)
        return
    detail += f"; az's default is {az_default}: az commands in the docs would go there"
    yield Check("subscription", WARNING, detail, fix or f"az account set --subscription {sub}")


def check_providers(ctx: Context) -> Iterator[Check]:
    states: dict[str, str] = {}
    with ctx.azure.resources(_sub(ctx)) as client:
        for namespace in PROVIDERS:
            states[namespace] = _text(client.providers.get(namespace).registration_state)
    missing = [ns for ns, state in states.items() if state != "Registered"]
    if not missing:
        yield Check("resource providers", OK, f"{len(states)} registered: {', '.join(states)}")
    for ns in missing:
        fix = f"az provider register --namespace {ns} --subscription {_sub(ctx)}"
        status = WARNING if states[ns] == "Registering" else FAILS
        yield Check(f"provider {ns}", status, f"{states[ns]}", fix)


def _sku_problem(sku: Any, region: str) -> str | None:
    for restriction in sku.restrictions or []:
        # A Location restriction withholds the size from the whole region; a Zone one only
        # from some zones, and the pools ask for no zone.
        if restriction.type == "Location":
            return (
                f"not offered to this subscription in {region} ({_text(restriction.reason_code)})"
            )
    return None


def check_vm_sizes(ctx: Context) -> Iterator[Check]:
    region = ctx.cfg.location
    wanted = {ctx.cfg.gpu_pool.vm_size, ctx.cfg.cluster.system_vm_size, BOOTSTRAP_VM_SIZE}
    lowered = {w.lower() for w in wanted}
    with ctx.azure.compute(_sub(ctx)) as client:
        for sku in client.resource_skus.list(filter=f"location eq '{region}'"):
            if sku.resource_type == "virtualMachines" and (sku.name or "").lower() in lowered:
                ctx.skus[sku.name.lower()] = sku
    fix = "pick a region that has it: python -m lab prices (then azure-native:location)"
    for size in sorted(wanted):
        role = "GPU Spot size" if size == ctx.cfg.gpu_pool.vm_size else "CPU size"
        sku = ctx.skus.get(size.lower())
        if sku is None:
            yield Check(f"{role} {size}", FAILS, f"not offered in {region}", fix)
            continue
        problem = _sku_problem(sku, region)
        capabilities = {c.name: c.value for c in sku.capabilities or []}
        spot = capabilities.get("LowPriorityCapable") != "False"
        if problem is None and size == ctx.cfg.gpu_pool.vm_size and not spot:
            problem = "offered, but not as Spot"
        if problem:
            yield Check(f"{role} {size}", FAILS, problem, fix)
            continue
        zones = sorted({z for info in sku.location_info or [] for z in info.zones or []})
        where = f"zones {', '.join(zones)}" if zones else "no zones"
        yield Check(f"{role} {size}", OK, f"offered in {region} ({where})")


def _vcpus(ctx: Context, size: str) -> int | None:
    sku = ctx.skus.get(size.lower())
    caps = {c.name: c.value for c in (sku.capabilities or [])} if sku else {}
    try:
        return int(caps["vCPUs"])
    except (KeyError, ValueError):
        return None


def check_quota(ctx: Context) -> Iterator[Check]:
    """Spot vCPUs for the GPU pool's ceiling; family and regional vCPUs for the CPU pools.

    Spot VMs of every size count against one regional quota, "Total Regional Spot vCPUs"
    (usage ``lowPriorityCores``), not their family's (Azure docs, "Azure Spot Virtual
    Machines": quota). Regular VMs count against their family and the regional total.
    """
    cfg, region = ctx.cfg, ctx.cfg.location
    with ctx.azure.compute(_sub(ctx)) as client:
        usages = {u.name.value: u for u in client.usage.list(region)}
    gpu = cfg.gpu_size
    yield _quota(
        "Spot vCPU quota",
        usages.get("lowPriorityCores"),
        cfg.gpu_max_nodes * gpu.vcpus,
        f"{cfg.gpu_max_nodes} × {gpu.name} at {gpu.vcpus}",
        f"request 'Total Regional Spot vCPUs' in {region} at {QUOTA_PAGE}, or lower "
        f"{cfg.key('gpuMaxNodes')}/{cfg.key('workerMaxReplicas')}",
    )
    pools = {BOOTSTRAP_VM_SIZE: 1}
    pools[cfg.cluster.system_vm_size] = pools.get(cfg.cluster.system_vm_size, 0) + (
        cfg.cluster.system_node_count
    )
    by_family: dict[str, tuple[int, list[str]]] = {}
    total = 0
    for size, count in pools.items():
        sku, vcpus = ctx.skus.get(size.lower()), _vcpus(ctx, size)
        if sku is None or vcpus is None:
            yield Check("CPU vCPU quota", SKIPPED, f"{size} is not offered in {region}")
            return
        needed, what = by_family.get(sku.family, (0, []))
        by_family[sku.family] = (needed + count * vcpus, [*what, f"{count} × {size}"])
        total += count * vcpus
    for family, (needed, what) in by_family.items():
        yield _quota(
            f"{family} quota",
            usages.get(family),
            needed,
            " + ".join(what),
            f"request more '{family}' vCPUs in {region} at {QUOTA_PAGE}",
        )
    yield _quota(
        "regional vCPU quota",
        usages.get("cores"),
        total,
        "the CPU pools",
        f"request more 'Total Regional vCPUs' in {region} at {QUOTA_PAGE}",
    )


def _quota(name: str, usage: Any, needed: int, what: str, fix: str) -> Check:
    if usage is None:
        return Check(name, WARNING, f"Azure reports no such quota; needs {needed} ({what})")
    used, limit = int(usage.current_value), int(usage.limit)
    detail = f"{used} used / {limit} limit, needs {needed} ({what})"
    if used + needed > limit:
        return Check(name, FAILS, detail, fix)
    return Check(name, OK, detail)


def action_matches(pattern: str, action: str) -> bool:
    """Azure RBAC action matching: case-insensitive, ``*`` matches any run of characters."""
    regex = ".*".join(re.escape(part) for part in pattern.lower().split("*"))
    return re.fullmatch(regex, action.lower()) is not None


def grants(permissions: Sequence[Any], action: str) -> bool:
    """Whether a role definition's permission blocks allow ``action``."""
    return any(
        any(action_matches(a, action) for a in p.actions or [])
        and not any(action_matches(n, action) for n in p.not_actions or [])
        for p in permissions
    )


def _covers_subscription(scope: str, sub: str) -> bool:
    scope = scope.lower().rstrip("/")
    return scope in ("", f"/subscriptions/{sub.lower()}") or scope.startswith(
        "/providers/microsoft.management/managementgroups/"
    )


def check_permissions(ctx: Context) -> Iterator[Check]:
    """The caller's roles at the subscription must allow new resource groups and role
    assignments. ``assignedTo('<object id>')`` includes the caller's groups (as
    ``az role assignment list --include-groups`` does); resource-group roles do not cover the
    group ``pulumi up`` creates. Eligible (PIM) roles that are not active do not count."""
    sub, oid = _sub(ctx), ctx.caller.get("oid")
    if not oid:
        yield Check("permissions", WARNING, "the sign-in token names no object id; not checked")
        return
    with ctx.azure.authorization(sub) as client:
        assignments = [
            a
            for a in client.role_assignments.list_for_subscription(filter=f"assignedTo('{oid}')")
            if _covers_subscription(a.scope or "", sub)
        ]
        roles = {
            a.role_definition_id: client.role_definitions.get_by_id(a.role_definition_id)
            for a in assignments
        }
    names = sorted({r.role_name for r in roles.values()}) or ["none"]
    held = f"roles at the subscription: {', '.join(names)}"
    fix = "ask an Owner of the subscription for Owner, or Contributor + User Access Administrator"
    needs = ((RESOURCE_GROUP_WRITE, "resource groups"), (ROLE_ASSIGNMENT_WRITE, "role assignments"))
    for action, what in needs:
        granting = [
            a for a in assignments if grants(roles[a.role_definition_id].permissions, action)
        ]
        if not granting:
            yield Check(f"may create {what}", FAILS, f"no role allows {action}; {held}", fix)
        elif all(a.condition for a in granting):
            yield Check(
                f"may create {what}",
                WARNING,
                f"only under a condition ({held}); it must allow AcrPull, Storage Blob Data "
                "Reader/Contributor and Azure Kubernetes Service RBAC Cluster Admin",
                fix,
            )
        else:
            yield Check(f"may create {what}", OK, held)


def check_acr_tasks(ctx: Context) -> Iterator[Check]:
    offer = ctx.offer or ""
    fallback = f"if the image build fails: pulumi config set {ctx.cfg.key('imageBuilder')} docker"
    if ctx.cfg.image_builder != "acr":
        yield Check("ACR Tasks", OK, f"not used (imageBuilder: {ctx.cfg.image_builder})")
    elif not offer:
        why = "the subscription shows no offer (quotaId), so whether ACR Tasks run is unknown"
        yield Check("ACR Tasks", WARNING, why, fallback)
    elif offer.startswith(NO_ACR_TASKS):
        yield Check(
            "ACR Tasks",
            FAILS,
            f"the subscription's offer ({offer}) runs no ACR Tasks: `az acr build` would fail",
            f"pulumi config set {ctx.cfg.key('imageBuilder')} docker (needs a local Docker)",
        )
    elif offer.startswith(CREDIT_OFFERS):
        yield Check(
            "ACR Tasks",
            WARNING,
            f"a credit-based offer ({offer}); some refuse ACR Tasks (TasksOperationsNotAllowed)",
            fallback,
        )
    else:
        yield Check("ACR Tasks", OK, f"allowed for the subscription's offer ({offer})")


def _text(value: object) -> str:
    """An SDK enum member as Azure spelled it (``NotAvailableForSubscription``)."""
    return str(getattr(value, "value", value))


def _sub(ctx: Context) -> str:
    assert ctx.subscription is not None  # check_subscription ran first and passed
    return ctx.subscription


# ---- running the checks ---------------------------------------------------------------------

AZURE_CHECKS: tuple[tuple[str, Callable[[Context], Iterator[Check]]], ...] = (
    ("sign-in", check_sign_in),
    ("subscription", check_subscription),
    ("resource providers", check_providers),
    ("VM sizes", check_vm_sizes),
    ("quota", check_quota),
    ("permissions", check_permissions),
    ("ACR Tasks", check_acr_tasks),
)


def _refusal(name: str, err: AzureError) -> Check:
    if isinstance(err, Refused) and err.status == 403:
        fix = "ask for Reader on the subscription (preflight only reads)"
        return Check(name, FAILS, f"Azure refused to show it: {err}", fix)
    return Check(name, FAILS, str(err))


def run_checks(ctx: Context) -> list[Check]:
    """Every check in order; a failure that leaves nothing to check skips the rest."""
    checks = [
        Check("stack config", OK, _describe(ctx.cfg, ctx.settings)),
        *check_tools(ctx),
    ]
    choose_subscription(ctx)
    for index, (name, check) in enumerate(AZURE_CHECKS):
        try:
            with azure_errors():
                found = list(check(ctx))
        except (Unreachable, NotSignedIn) as err:
            fix = "az login" if isinstance(err, NotSignedIn) else ""
            checks.append(Check("azure", FAILS, str(err), fix))
            checks += [Check(n, SKIPPED, "needs Azure") for n, _ in AZURE_CHECKS[index:]]
            break
        except AzureError as err:
            found = [_refusal(name, err)]
        checks += found
        if name == "subscription" and any(c.status == FAILS for c in found):
            rest = AZURE_CHECKS[index + 1 :]
            checks += [Check(n, SKIPPED, "needs the subscription") for n, _ in rest]
            break
    return checks


def _describe(cfg: LabConfig, settings: StackSettings) -> str:
    return (
        f"stack {cfg.stack}: {cfg.gpu_max_nodes} × {cfg.gpu_pool.vm_size} Spot in {cfg.location}, "
        f"{cfg.cluster.system_node_count} × {cfg.cluster.system_vm_size}, "
        f"imageBuilder {cfg.image_builder}"
    )


def exit_code(checks: list[Check]) -> int:
    return EXIT_FAILED if any(c.status == FAILS for c in checks) else EXIT_OK


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<8} {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (FAILS, WARNING):
            lines.append(f"{'':<8} {'':<{width}}  fix: {c.fix}")
    failed = sum(c.status == FAILS for c in checks)
    lines.append(
        "pulumi up can go ahead." if not failed else f"{failed} check(s) fail: fix them first."
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lab preflight",
        description=(
            "Check, before it creates and bills anything, that `pulumi up` will work: the stack "
            "config, the tools it runs (pulumi, az signed in, git, kubelogin; docker for "
            "imageBuilder docker), the subscription it deploys into, resource providers, the "
            "VM sizes in the region, Spot and CPU quotas, permission to create role "
            "assignments, and ACR Tasks for the subscription's offer. Only reads. Signs in as "
            "`pulumi up` does: ARM_CLIENT_ID/ARM_CLIENT_SECRET/ARM_TENANT_ID, else az login.\n"
            "Exit status: 0 pulumi up can go ahead, 1 a check fails, 2 bad input."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--stack",
        help="stack to check, as in Pulumi.<stack>.yaml (default: the selected Pulumi stack)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    return parser


def main(
    argv: Sequence[str] | None = None,
    azure: Azure | None = None,
    project_dir: Path = PROJECT_DIR,
    run: Runner = run_tool,
) -> int:
    """Entry point; ``azure`` and ``run`` are for tests."""
    args = build_parser().parse_args(argv)
    try:
        settings = resolve_stack(args.stack, project_dir)
    except ConfigError as err:
        if args.json:
            print(json.dumps({"ok": False, "exit_code": EXIT_BAD_INPUT, "error": err.problems}))
        else:
            print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    ctx = Context(settings, azure or Azure(), run)
    checks = run_checks(ctx)
    code = exit_code(checks)
    if args.json:
        report = {"stack": settings.config.stack, "ok": code == EXIT_OK, "exit_code": code}
        print(json.dumps({**report, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(format_checks(checks))
    return code
