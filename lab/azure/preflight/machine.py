"""Checks on this machine: the tools ``pulumi up`` runs, and az signed in."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

from lab.azure.preflight.context import FAILS, OK, Check, Context


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
        # `pulumi up` asks the cluster with kubectl whether the deployer's role applies
        # (infra/cluster_access.py): without it the up fails after building the cluster.
        ("kubectl", ["kubectl", "version", "--client"], FAILS, "az aks install-cli"),
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
