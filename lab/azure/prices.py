"""``python -m lab prices``: where the GPU size's Spot nodes are cheap and rarely evicted.

Joins two sources per region: the Retail Prices API (Spot and on-demand Linux list prices,
public) and Azure Resource Graph (the Spot eviction-rate band, needs a sign-in). A region
missing from one source still gets a row. Below the table, what the stack costs while it
stands idle, from the same price list.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from infra import gpu_sizes
from infra.cluster import BOOTSTRAP_VM_SIZE
from lab.azure.api_cache import ApiCache, cache_dir
from lab.azure.clients import RETAIL_PRICES, Azure, AzureError, NotSignedIn
from lab.azure.eviction_rates import band_floor, eviction_bands
from lab.azure.retail_prices import HOURS_PER_MONTH, RetailPrices, VmPrice, monthly
from lab.azure.stack_choice import resolve_stack
from lab.exit_status import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from stack_config.files import PROJECT_DIR
from stack_config.model import ConfigError, LabConfig
from stack_config.validate import REGION


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


def _money(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"${value:,.{digits}f}"


def format_report(report: dict) -> str:
    """The table a human reads; ``report`` is what ``--json`` prints."""
    rows = report["regions"]
    hours, workers = report["hours"], report["workers"]
    cost_head = f"{hours:g} h × {workers} Spot"
    header = ("#", "region", "Spot $/h", "on-demand $/h", "saving", "eviction/h", cost_head)
    table = [header]
    for index, row in enumerate(rows, 1):
        saving = "n/a" if row["saving"] is None else f"{row['saving']:.0%}"
        eviction = f"{row['eviction']} %" if row["eviction"] else report["eviction_note"]
        mark = " (stack)" if row["region"] == report["stack_region"] else ""
        table.append(
            (
                str(index),
                row["region"] + mark,
                _money(row["spot"], 4),
                _money(row["on_demand"], 4),
                saving,
                eviction,
                _money(row["run_cost"], 2),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        f"{report['vm_size']} ({report['gpus']}× {report['gpu_model']}, {report['vcpus']} vCPUs), "
        f"Linux, USD list prices; stack {report['stack']}",
        _headline(report),
        "",
        *(
            "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in table
        ),
        "",
        f"Idle cost of stack {report['stack']} in {report['stack_region']}, per month "
        f"({HOURS_PER_MONTH} h, on-demand list prices):",
    ]
    idle = report["idle"]
    name_width = max(len(item["name"]) for item in idle["items"])
    what_width = max(len(item["what"]) for item in idle["items"])
    for item in idle["items"]:
        lines.append(
            f"  {item['name'].ljust(name_width)}  {item['what'].ljust(what_width)}  "
            f"{_money(item['monthly'], 2).rjust(10)}"
        )
    total = _money(idle["total"], 2).rjust(10)
    lines.append(f"  {'total'.ljust(name_width)}  {''.ljust(what_width)}  {total}")
    lines.append(f"  not counted: {NOT_COUNTED}")
    lines.append(f"Prices taken {report['prices_taken']}; eviction bands {report['bands_taken']}.")
    return "\n".join(lines)


def _headline(report: dict) -> str:
    region = report["stack_region"]
    rows = report["regions"]
    position = next((i for i, r in enumerate(rows, 1) if r["region"] == region), None)
    if position is None:
        return f"The stack's region {region}: no price or eviction data for this size there."
    row = rows[position - 1]
    band = f"{row['eviction']} %" if row["eviction"] else report["eviction_note"]
    return (
        f"The stack's region {region}: rank {position} of {len(rows)}, "
        f"Spot {_money(row['spot'], 4)}/h, eviction {band}."
    )


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
        "prices_taken": _stamp(prices_taken),
        "bands_taken": _stamp(bands_taken),
    }


# ---- the command ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lab prices",
        description=(
            "Rank Azure regions for the stack's GPU Spot size by what a run costs, with each "
            "region's Spot eviction-rate band, and show what the lab costs while idle.\n"
            "Prices: the public Azure Retail Prices API. Eviction bands: Azure Resource Graph, "
            "with the identity `pulumi up` uses (az login, or ARM_CLIENT_ID/ARM_CLIENT_SECRET/"
            "ARM_TENANT_ID); without a sign-in that column says so and the rest still prints. "
            "Answers are cached in $XDG_CACHE_HOME/spot-lab (12 h prices, 1 h bands).\n"
            "Exit status: 0 printed, 1 Azure cannot be reached or refuses, 2 bad input."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--stack",
        help="stack whose config gives the defaults (default: the selected Pulumi stack, "
        "else Pulumi.yaml's defaults)",
    )
    parser.add_argument(
        "--vm-size",
        help="GPU VM size (default: the stack's gpuVmSize); one of: "
        + ", ".join(s.name for s in gpu_sizes.SIZES),
    )
    parser.add_argument(
        "--regions",
        default="all",
        help="comma-separated Azure regions such as westus3,eastus, or 'all' (default: all)",
    )
    parser.add_argument(
        "--hours",
        type=float,
        default=24.0,
        help="hours of training to price, for the stack's workerMaxReplicas nodes (default: 24)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--refresh", action="store_true", help="ask the APIs again instead of the cache"
    )
    return parser


def parse_regions(value: str) -> list[str] | None:
    """None for 'all', else the validated list; ``ConfigError`` names the bad one."""
    if value.strip().lower() == "all":
        return None
    regions = [r.strip().lower() for r in value.split(",") if r.strip()]
    bad = [r for r in regions if not REGION.match(r)]
    if not regions or bad:
        raise ConfigError(
            [f"--regions must be 'all' or Azure region names such as westus3,eastus; got {value!r}"]
        )
    return regions


def _stack_config(name: str | None, project_dir: Path) -> LabConfig:
    try:
        return resolve_stack(name, project_dir).config
    except ConfigError:
        if name:
            raise
        return LabConfig(project="spot-lab", stack="(Pulumi.yaml defaults)")


def main(
    argv: Sequence[str] | None = None,
    azure: Azure | None = None,
    project_dir: Path = PROJECT_DIR,
) -> int:
    """Entry point; ``azure`` is for tests (fake credential, replayed answers)."""
    args = build_parser().parse_args(argv)
    try:
        cfg = _stack_config(args.stack, project_dir)
        vm_size = args.vm_size or cfg.gpu_pool.vm_size
        if gpu_sizes.gpu_size(vm_size) is None:
            allowed = ", ".join(s.name for s in gpu_sizes.SIZES)
            raise ConfigError([f"--vm-size must be one of {allowed}; got {vm_size!r}"])
        if not args.hours > 0:
            raise ConfigError([f"--hours must be a number of hours > 0; got {args.hours:g}"])
        regions = parse_regions(args.regions)
    except ConfigError as err:
        print(f"error: {'; '.join(err.problems)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    cache = ApiCache(cache_dir(), refresh=args.refresh)
    try:
        report = build_report(azure or Azure(), cache, cfg, vm_size, regions, args.hours)
    except AzureError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return EXIT_OK


def cached_vm_price(vm_size: str, region: str) -> tuple[float | None, float | None] | None:
    """(Spot, on-demand) $/h of a size in a region from the cache of an earlier ``lab prices``
    run, never from the network (a report is built offline); None when not cached."""

    def offline() -> None:
        raise AzureError("not in the cache")

    retail = RetailPrices(Azure().public(RETAIL_PRICES), ApiCache(cache_dir()), offline)
    for regions in ([region], None):  # `lab prices --regions <region>`, or all regions
        try:
            prices, _ = retail.vm_prices(vm_size, regions)
        except AzureError:
            continue
        found = next((p for p in prices if p.region == region), None)
        if found is not None:
            return found.spot, found.on_demand
    return None
