"""Checks of the identity ``pulumi up`` deploys as: who signs in, who that makes the cluster's
admin (and whether kubelogin can sign in as it), and whether its roles at the subscription let
it create the resource group and the role assignments."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

from catalog.deployer import AZURE_CLI_LOGIN
from lab.azure.clients import ARM, deployer
from lab.azure.preflight.context import FAILS, OK, WARNING, Check, Context

# What ``pulumi up`` needs at subscription scope: a new resource group, and role assignments
# for the identities and for the deployer (infra/roles.py).
ROLE_ASSIGNMENT_WRITE = "Microsoft.Authorization/roleAssignments/write"
RESOURCE_GROUP_WRITE = "Microsoft.Resources/subscriptions/resourceGroups/write"


def check_sign_in(ctx: Context) -> Iterator[Check]:
    how = deployer(ctx.environ, ctx.settings.provider).describe()
    ctx.azure.probe(ARM)
    ctx.caller = ctx.azure.caller()
    who = ctx.caller.get("upn") or ctx.caller.get("unique_name") or ctx.caller.get("appid", "?")
    yield Check("sign-in", OK, f"{who} (object id {ctx.caller.get('oid', '?')}) via {how}")


def check_cluster_admin(ctx: Context) -> Iterator[Check]:
    """Who ``pulumi up`` makes the cluster's admin, as ``__main__.py`` decides it: the object id
    ``getClientConfig`` names (the token's ``oid``), its principal type from the client id
    (the token's ``appid``: the Azure CLI's own for a user), and the kubelogin sign-in that
    reaches the cluster as the same identity (``catalog/deployer.py``)."""
    who = deployer(ctx.environ, ctx.settings.provider)
    oid, tenant = ctx.caller.get("oid", ""), ctx.caller.get("tid", "")
    client_id = ctx.caller.get("appid") or ctx.caller.get("azp") or ""
    if not (oid and tenant and client_id):
        why = "the sign-in token names no object id, tenant or client id: not checked"
        yield Check("cluster admin", WARNING, why)
        return
    kind = who.principal_type(client_id)
    flags = " ".join(who.login_flags(tenant, kind))
    name = ctx.caller.get("upn") or ctx.caller.get("unique_name") or client_id
    detail = f"{name}, {kind} {oid}; kubelogin {flags}"
    needs = who.kubelogin_needs()
    variable = needs.split(" ", 1)[0]  # the catalog names the variable first
    if needs and not ctx.environ.get(variable):
        fix = f"export {needs}: kubelogin reads it there, never from the kubeconfig"
        yield Check("cluster admin", FAILS, f"{detail}; {variable} is not set", fix)
        return
    hidden_secret = who.login == AZURE_CLI_LOGIN and (
        ctx.settings.provider.get("clientId") or ctx.environ.get("ARM_CLIENT_ID")
    )
    if hidden_secret:
        yield Check(
            "cluster admin",
            WARNING,
            f"{detail}; a client id is set with no secret or certificate visible here",
            "if the stack holds an encrypted azure-native:clientSecret, pulumi up signs in as "
            "that service principal instead: export ARM_CLIENT_SECRET and AZURE_CLIENT_SECRET "
            "and run preflight again",
        )
        return
    yield Check("cluster admin", OK, detail)


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
    sub, oid = ctx.sub, ctx.caller.get("oid")
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
