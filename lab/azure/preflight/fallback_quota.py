"""With the on-demand fallback on: the regular vCPU quota its nodes draw on.

Spot VMs of every size count against one regional Spot quota (``region.py``); regular VMs
count against their size family's quota and the region's total, "Total Regional vCPUs" (usage
``cores``) (Azure docs, "Azure Spot Virtual Machines" and "vCPU quotas"). The family quota's
usage name is the size's Resource SKU ``family`` (``standardNCASv3_T4Family`` for the T4 sizes),
which the VM size check found. GPU families start at 0 on most subscriptions, so a fallback
without its quota would fail on the very day Spot has no capacity.
"""

from __future__ import annotations

from collections.abc import Iterator

from lab.azure.preflight.context import SKIPPED, Check, Context
from lab.azure.preflight.region import QUOTA_PAGE, cpu_pool_nodes, quota_check, sku_vcpus

NAME = "on-demand fallback quota"


def check_fallback_quota(ctx: Context) -> Iterator[Check]:
    """The fallback's family quota, and the regional total with the CPU pools beside it."""
    cfg, region = ctx.cfg, ctx.cfg.location
    if not cfg.fallback.enabled:
        return
    size, nodes = cfg.gpu_pool.vm_size, cfg.fallback.max_nodes
    sku, vcpus = ctx.skus.get(size.lower()), sku_vcpus(ctx, size)
    pools = {s: (sku_vcpus(ctx, s), count) for s, count in cpu_pool_nodes(cfg).items()}
    if sku is None or vcpus is None or not sku.family or None in (v for v, _ in pools.values()):
        yield Check(NAME, SKIPPED, f"a size of the stack is not offered in {region}")
        return
    with ctx.azure.compute(ctx.sub) as client:
        usages = {u.name.value: u for u in client.usage.list(region)}
    needed, what = nodes * vcpus, f"{nodes} × {size} at {vcpus} on demand"
    lower = f"or lower {cfg.key('onDemandMaxNodes')}"
    yield quota_check(
        f"{sku.family} quota ({NAME})",
        usages.get(sku.family),
        needed,
        what,
        f"request '{sku.family}' vCPUs in {region} at {QUOTA_PAGE}, {lower}",
    )
    cpu = sum(v * count for v, count in pools.values() if v is not None)
    yield quota_check(
        "regional vCPU quota with the fallback",
        usages.get("cores"),
        cpu + needed,
        f"the CPU pools' {cpu} + {what}",
        f"request more 'Total Regional vCPUs' in {region} at {QUOTA_PAGE}, {lower}",
    )
