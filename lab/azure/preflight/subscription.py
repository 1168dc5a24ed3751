"""Checks of the subscription ``pulumi up`` deploys into: which one, its state, its resource
providers, and whether its offer runs ACR Tasks."""

from __future__ import annotations

from collections.abc import Iterator

from lab.azure.preflight.context import FAILS, OK, WARNING, Check, Context, enum_text

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
# ACR Tasks runs are paused for subscriptions on Azure free credits: `az acr build` fails
# with TasksOperationsNotAllowed (ACR Tasks overview on learn.microsoft.com; Azure/acr and
# azure-search-openai-demo#2592 show the error). Offer ids are the subscription's quotaId.
NO_ACR_TASKS = ("FreeTrial_", "AzureForStudents_", "AzurePass_")
CREDIT_OFFERS = ("MSDN_", "MSDNDevTest_", "Sponsored_", "BizSpark", "AzureInOpen_")


def choose_subscription(ctx: Context) -> None:
    """The subscription pulumi-azure-native deploys into, and where that comes from."""
    if ctx.settings.subscription_id:
        ctx.subscription, ctx.subscription_source = ctx.settings.subscription_id, "stack config"
    elif ctx.environ.get("ARM_SUBSCRIPTION_ID"):
        ctx.subscription = ctx.environ["ARM_SUBSCRIPTION_ID"]
        ctx.subscription_source = "ARM_SUBSCRIPTION_ID"
    elif ctx.az_account:
        ctx.subscription, ctx.subscription_source = ctx.az_account.get("id"), "az's default"


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
        yield Check("subscription", FAILS, f"{detail} is {enum_text(found.state)}", enable)
        return
    status, fix = (OK, "") if found.state == "Enabled" else (WARNING, enable)
    if found.state != "Enabled":
        detail += f", {enum_text(found.state)}"
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
    with ctx.azure.resources(ctx.sub) as client:
        for namespace in PROVIDERS:
            states[namespace] = enum_text(client.providers.get(namespace).registration_state)
    missing = [ns for ns, state in states.items() if state != "Registered"]
    if not missing:
        yield Check("resource providers", OK, f"{len(states)} registered: {', '.join(states)}")
    for ns in missing:
        fix = f"az provider register --namespace {ns} --subscription {ctx.sub}"
        status = WARNING if states[ns] == "Registering" else FAILS
        yield Check(f"provider {ns}", status, f"{states[ns]}", fix)


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
