"""``python -m lab preflight``: will ``pulumi up`` work, before it creates and bills anything?

Reads the stack exactly as ``pulumi up`` does, then checks the machine (tools, logins), who
signs in and who that makes the cluster's admin, the subscription (providers, VM sizes,
quotas, the Kubernetes version, permissions, ACR Tasks) and the images' bases in their
registry. It only reads: every Azure call is a GET, every registry call a HEAD or a GET,
every local tool is asked for its version or its account.

Exit 0: ``pulumi up`` can go ahead (warnings allowed). 1: a check fails. 2: bad input.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

from lab.azure.clients import Azure, AzureError, NotSignedIn, Refused, Unreachable, azure_errors
from lab.azure.preflight.base_images import check_base_images
from lab.azure.preflight.context import (
    FAILS,
    OK,
    SKIPPED,
    WARNING,
    Check,
    Context,
    Runner,
    run_tool,
)
from lab.azure.preflight.fallback_quota import check_fallback_quota
from lab.azure.preflight.flags import build_parser
from lab.azure.preflight.identity import check_cluster_admin, check_permissions, check_sign_in
from lab.azure.preflight.image_registry import Registry, registry_for
from lab.azure.preflight.infiniband import check_infiniband
from lab.azure.preflight.kubernetes_version import check_kubernetes_version
from lab.azure.preflight.machine import check_tools
from lab.azure.preflight.region import check_quota, check_vm_sizes
from lab.azure.preflight.subscription import (
    check_acr_tasks,
    check_providers,
    check_subscription,
    choose_subscription,
)
from lab.azure.stack_choice import resolve_stack
from stack_config.files import PROJECT_DIR, StackSettings
from stack_config.model import ConfigError, LabConfig
from training.elastic import exit_codes

AZURE_CHECKS: tuple[tuple[str, Callable[[Context], Iterator[Check]]], ...] = (
    ("sign-in", check_sign_in),
    ("cluster admin", check_cluster_admin),
    ("subscription", check_subscription),
    ("resource providers", check_providers),
    ("VM sizes", check_vm_sizes),
    ("InfiniBand", check_infiniband),
    ("quota", check_quota),
    ("on-demand fallback quota", check_fallback_quota),
    ("Kubernetes version", check_kubernetes_version),
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
    return checks + list(check_base_images(ctx))


def _describe(cfg: LabConfig, settings: StackSettings) -> str:
    fallback = f" (+{cfg.fallback.max_nodes} on demand)" if cfg.fallback.enabled else ""
    return (
        f"stack {cfg.stack}: {cfg.gpu_max_nodes} × {cfg.gpu_pool.vm_size} Spot{fallback} in "
        f"{cfg.location}, "
        f"{cfg.cluster.system_node_count} × {cfg.cluster.system_vm_size}, "
        f"imageBuilder {cfg.image_builder}"
    )


def exit_code(checks: list[Check]) -> int:
    return exit_codes.PERMANENT if any(c.status == FAILS for c in checks) else exit_codes.OK


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


def main(
    argv: Sequence[str] | None = None,
    azure: Azure | None = None,
    project_dir: Path = PROJECT_DIR,
    run: Runner = run_tool,
    registry: Callable[[str], Registry] | None = None,
) -> int:
    """Entry point; ``azure``, ``run`` and ``registry`` are for tests."""
    args = build_parser().parse_args(argv)
    try:
        settings = resolve_stack(args.stack, project_dir)
    except ConfigError as err:
        if args.json:
            print(
                json.dumps({"ok": False, "exit_code": exit_codes.BAD_INPUT, "error": err.problems})
            )
        else:
            print(f"error: {err}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    azure = azure or Azure(provider=settings.provider)
    ctx = Context(settings, azure, run, registry=registry or registry_for)
    checks = run_checks(ctx)
    code = exit_code(checks)
    if args.json:
        report = {"stack": settings.config.stack, "ok": code == exit_codes.OK, "exit_code": code}
        print(json.dumps({**report, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(format_checks(checks))
    return code
