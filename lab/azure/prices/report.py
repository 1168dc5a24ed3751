"""What ``lab prices`` reports, as plain data: the regions ranked for the GPU size, what the
stack costs while idle, and, with the on-demand fallback on, what its nodes cost.

Joins two sources per region: the Retail Prices API (Spot and on-demand Linux list prices,
public) and Azure Resource Graph (the Spot eviction-rate band, needs a sign-in). A region
missing from one source still gets a row.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

from catalog import gpu_sizes
from infra.node_pools import BOOTSTRAP_VM_SIZE
from lab.azure.clients import RETAIL_PRICES, Azure, AzureError, NotSignedIn
from lab.azure.prices.cache import ApiCache
from lab.azure.prices.evictions import band_floor, eviction_bands
from lab.azure.prices.retail import HOURS_PER_MONTH, RetailPrices, VmPrice, monthly
from lab.report.headroom import (
    HeadroomPlan,
    band_rate,
    cost_per_1000_steps,
    hours_per_1000_steps,
    recommend,
)
from stack_config.model import LabConfig


@dataclass(frozen=True)
class Meter:
    """A fixed resource of the lab, as the Retail Prices API names its meter."""

    name: str
    service: str
    sku: str
    meter: str
    what: str


# AKS's outbound Standard load balancer (up to 5 rules are one hourly charge), its static
# public IPv4, and the Basic registry (infra/registry.py), which is billed per day.
FIXED_METERS = (
    Meter(
        "load balancer",
        "Load Balancer",
        "Standard",
        "Standard Included LB Rules and Outbound Rules",
        "Standard, up to 5 rules",
    ),
    Meter(
        "public IP",
        "Virtual Network",
        "Standard",
        "Standard IPv4 Static Public IP",
        "Standard static IPv4, outbound",
    ),
    Meter("registry", "Container Registry", "Basic", "Basic Registry Unit", "Basic"),
)
NOT_COUNTED = "OS disks of the CPU nodes, storage, egress; the GPU pool scales to 0 when idle"


@dataclass(frozen=True)
class Row:
    """One region of the table."""

    region: str
    spot: float | None
    on_demand: float | None
    saving: float | None
    eviction: str | None
    run_cost: float | None
    """Spot cost of ``hours`` of ``workers`` nodes."""


@dataclass(frozen=True)
class IdleItem:
    name: str
    what: str
    monthly: float | None
    """None: the price list has no such meter in the region."""


def rank(prices: list[VmPrice], bands: dict[str, str], hours: float, workers: int) -> list[Row]:
    """Rows for every region either source knows, cheapest run first, then lowest band."""
    by_region = {p.region: p for p in prices}
    rows = []
    for region in sorted(set(by_region) | set(bands)):
        price = by_region.get(region, VmPrice(region, None, None))
        cost = None if price.spot is None else price.spot * hours * workers
        rows.append(Row(region, price.spot, price.on_demand, price.saving, bands.get(region), cost))
    no_price = float("inf")
    return sorted(
        rows,
        key=lambda r: (r.run_cost if r.run_cost is not None else no_price, band_floor(r.eviction)),
    )


def idle_cost(retail: RetailPrices, cfg: LabConfig) -> list[IdleItem]:
    """What the stack costs per month with no GPU node: CPU pools and fixed resources."""
    region = cfg.location
    system = cfg.cluster.system_vm_size
    nodes = {BOOTSTRAP_VM_SIZE: 1}
    nodes[system] = nodes.get(system, 0) + cfg.cluster.system_node_count
    vm_total: float | None = 0.0
    for size, count in nodes.items():
        prices, _ = retail.vm_prices(size, [region])
        hourly = next((p.on_demand for p in prices if p.region == region), None)
        vm_total = None if hourly is None or vm_total is None else vm_total + hourly * count
    what = f"{cfg.cluster.system_node_count} × {system} + bootstrap 1 × {BOOTSTRAP_VM_SIZE}"
    items = [IdleItem("CPU pools", what, None if vm_total is None else vm_total * HOURS_PER_MONTH)]
    for m in FIXED_METERS:
        found = retail.meter_price(region, m.service, m.sku, m.meter)
        items.append(IdleItem(m.name, m.what, None if found is None else monthly(*found)))
    return items


def fallback_price(cfg: LabConfig, rows: list[Row], hours: float) -> dict | None:
    """With the on-demand fallback on: what a node of it costs in the stack's region beside a
    Spot node, and ``hours`` of all its nodes; None when the fallback is off."""
    if not cfg.fallback.enabled:
        return None
    nodes = cfg.fallback.max_nodes
    row = next((r for r in rows if r.region == cfg.location), None)
    spot, on_demand = (row.spot, row.on_demand) if row else (None, None)
    return {
        "max_nodes": nodes,
        "region": cfg.location,
        "on_demand_usd_per_h": on_demand,
        "spot_usd_per_h": spot,
        "times_spot": round(on_demand / spot, 2) if on_demand and spot else None,
        "run_cost": None if on_demand is None else on_demand * hours * nodes,
    }


def _stamp(at: float | None) -> str:
    return "n/a" if at is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at))


def build_report(
    azure: Azure,
    cache: ApiCache,
    cfg: LabConfig,
    vm_size: str,
    regions: list[str] | None,
    hours: float,
) -> dict:
    """Everything the command prints, as plain data."""
    size = gpu_sizes.gpu_size(vm_size)
    assert size is not None  # parse_args checked it
    workers = cfg.job.max_replicas
    retail = RetailPrices(azure.public(RETAIL_PRICES), cache, lambda: azure.probe(RETAIL_PRICES))
    prices, prices_taken = retail.vm_prices(size.name, regions)
    idle = idle_cost(retail, cfg)
    bands: dict[str, str] = {}
    bands_taken: float | None = None
    try:
        bands, bands_taken = eviction_bands(azure, cache, size.name)
        note = "no data"
    except NotSignedIn:
        note = "needs az login"
    except AzureError as err:
        note = "unavailable"
        print(f"warning: eviction bands unavailable: {err}", file=sys.stderr)
    if regions:
        # Resource Graph answers for every region; a region no source knows still gets a row.
        bands = {r: b for r, b in bands.items() if r in regions}
        prices = [p for p in prices if p.region in regions]
        prices += [VmPrice(r, None, None) for r in regions if r not in {p.region for p in prices}]
    rows = rank(prices, bands, hours, workers)
    costs = [item.monthly for item in idle]
    fallback = fallback_price(cfg, rows, hours)
    return {
        "stack": cfg.stack,
        "stack_region": cfg.location,
        "vm_size": size.name,
        "gpus": size.gpus,
        "gpu_model": size.gpu_model,
        "vcpus": size.vcpus,
        "hours": hours,
        "workers": workers,
        "regions": [asdict(row) for row in rows],
        "eviction_note": note,
        "idle": {
            "items": [asdict(item) for item in idle],
            "total": None if None in costs else sum(c for c in costs if c is not None),
            "not_counted": NOT_COUNTED,
        },
        "fallback": fallback,
        "prices_taken": _stamp(prices_taken),
        "bands_taken": _stamp(bands_taken),
    }


def headroom_section(report: dict, plan: HeadroomPlan) -> dict:
    """The job's headroom in the stack's region: the model's answer (``lab.report.headroom``),
    and with a step time, what 1,000 steps cost at Spot with it and on demand without."""
    row = next((r for r in report["regions"] if r["region"] == report["stack_region"]), None)
    band = row["eviction"] if row else None
    if plan.rate_pct is not None:
        rate, rate_source = plan.rate_pct / 100.0, "--eviction-rate"
    else:
        rate, rate_source = band_rate(band), f"the upper end of the band {band} %"
    base = {
        "target": plan.target,
        "probability": plan.probability,
        "replacement_min": plan.replacement_min,
        "replacement_source": plan.replacement_source,
    }
    if rate is None:
        why = report["eviction_note"] if row else "no data for the stack's region"
        return base | {"note": f"no eviction rate ({why}): pass --eviction-rate"}
    model = recommend(rate, plan.replacement_min / 60.0, plan.target, plan.probability)
    section = base | {
        "eviction_rate_pct": round(rate * 100.0, 6),
        "rate_source": rate_source,
        "unavailability": model.unavailability,
        "workers": model.workers,
        "expected_missing": model.expected_missing,
        "achieved": model.achieved,
        "without_headroom": model.without_headroom,
        "step_s": plan.step_s,
    }
    if plan.step_s is None:
        return section
    spot = row["spot"] if row else None
    on_demand = row["on_demand"] if row else None
    training = model.workers - model.expected_missing
    return section | {
        "spot_usd_per_1000_steps": cost_per_1000_steps(spot, plan.step_s, plan.target),
        "spot_hours_per_1000_steps": hours_per_1000_steps(training, plan.step_s, plan.target),
        "on_demand_usd_per_1000_steps": cost_per_1000_steps(on_demand, plan.step_s, plan.target),
        "on_demand_hours_per_1000_steps": hours_per_1000_steps(
            plan.target, plan.step_s, plan.target
        ),
    }
