"""Checks of what the region offers the subscription: the pools' VM sizes (the GPU size as
Spot) and the vCPU quotas they count against."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from infra.node_pools import BOOTSTRAP_VM_SIZE
from lab.azure.preflight.context import FAILS, OK, SKIPPED, WARNING, Check, Context, enum_text
from stack_config.model import LabConfig

QUOTA_PAGE = "https://portal.azure.com/#view/Microsoft_Azure_Capacity/QuotaMenuBlade/~/myQuotas"


def _sku_problem(sku: Any, region: str) -> str | None:
    for restriction in sku.restrictions or []:
        # A Location restriction withholds the size from the whole region; a Zone one only
        # from some zones, and the pools ask for no zone.
        if restriction.type == "Location":
            reason = enum_text(restriction.reason_code)
            return f"not offered to this subscription in {region} ({reason})"
    return None


def check_vm_sizes(ctx: Context) -> Iterator[Check]:
    region = ctx.cfg.location
    wanted = {ctx.cfg.gpu_pool.vm_size, ctx.cfg.cluster.system_vm_size, BOOTSTRAP_VM_SIZE}
    lowered = {w.lower() for w in wanted}
    with ctx.azure.compute(ctx.sub) as client:
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


def sku_vcpus(ctx: Context, size: str) -> int | None:
    """The vCPUs of a size the VM size check found offered (None: not offered)."""
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
    with ctx.azure.compute(ctx.sub) as client:
        usages = {u.name.value: u for u in client.usage.list(region)}
    gpu = cfg.gpu_size
    yield quota_check(
        "Spot vCPU quota",
        usages.get("lowPriorityCores"),
        cfg.gpu_max_nodes * gpu.vcpus,
        f"{cfg.gpu_max_nodes} × {gpu.name} at {gpu.vcpus}",
        f"request 'Total Regional Spot vCPUs' in {region} at {QUOTA_PAGE}, or lower "
        f"{cfg.key('gpuMaxNodes')}/{cfg.key('workerMaxReplicas')}",
    )
    pools = cpu_pool_nodes(cfg)
    by_family: dict[str, tuple[int, list[str]]] = {}
    total = 0
    for size, count in pools.items():
        sku, vcpus = ctx.skus.get(size.lower()), sku_vcpus(ctx, size)
        if sku is None or vcpus is None:
            yield Check("CPU vCPU quota", SKIPPED, f"{size} is not offered in {region}")
            return
        needed, what = by_family.get(sku.family, (0, []))
        by_family[sku.family] = (needed + count * vcpus, [*what, f"{count} × {size}"])
        total += count * vcpus
    for family, (needed, what) in by_family.items():
        yield quota_check(
            f"{family} quota",
            usages.get(family),
            needed,
            " + ".join(what),
            f"request more '{family}' vCPUs in {region} at {QUOTA_PAGE}",
        )
    yield quota_check(
        "regional vCPU quota",
        usages.get("cores"),
        total,
        "the CPU pools",
        f"request more 'Total Regional vCPUs' in {region} at {QUOTA_PAGE}",
    )


def cpu_pool_nodes(cfg: LabConfig) -> dict[str, int]:
    """Nodes per VM size of the CPU pools: the bootstrap pool and the pool for etcd."""
    pools = {BOOTSTRAP_VM_SIZE: 1}
    system = cfg.cluster.system_vm_size
    pools[system] = pools.get(system, 0) + cfg.cluster.system_node_count
    return pools


def quota_check(name: str, usage: Any, needed: int, what: str, fix: str) -> Check:
    """One quota's line: fails when what is used plus what is needed passes the limit."""
    if usage is None:
        return Check(name, WARNING, f"Azure reports no such quota; needs {needed} ({what})")
    used, limit = int(usage.current_value), int(usage.limit)
    detail = f"{used} used / {limit} limit, needs {needed} ({what})"
    if used + needed > limit:
        return Check(name, FAILS, detail, fix)
    return Check(name, OK, detail)
