"""``python -m lab prices``: where the GPU size's Spot nodes are cheap and rarely evicted.

Ranks regions by what a run costs at Spot, with each region's eviction band
(``report.py`` gathers it, ``table.py`` prints it); below the table, what the
stack costs while it stands idle and, with the on-demand fallback on, what its on-demand nodes
cost beside Spot.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from catalog import gpu_sizes
from lab.azure.prices.cache import ApiCache, cache_dir
from lab.azure.stack_choice import resolve_stack
from lab.exit_status import HelpFormatter
from lab.report.headroom import (
    REPLACEMENT_MIN,
    HeadroomError,
    HeadroomPlan,
    check_inputs,
    measured_replacement_s,
)
from stack_config.files import PROJECT_DIR
from stack_config.model import ConfigError, LabConfig
from stack_config.validate import REGION
from training.elastic.exit_codes import BAD_INPUT, OK, PERMANENT

if TYPE_CHECKING:  # the Azure SDKs load when the command asks Azure, not for --help
    from lab.azure.clients import Azure


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
        formatter_class=HelpFormatter,
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
    _headroom_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--refresh", action="store_true", help="ask the APIs again instead of the cache"
    )
    return parser


def _headroom_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the headroom recommendation (docs/azure.md, "Headroom, not spares")."""
    group = parser.add_argument_group(
        "headroom",
        "how many workers to ask for so that a target world size trains with a probability, "
        "from the stack region's eviction rate and the time a replacement takes",
    )
    group.add_argument(
        "--target-workers",
        type=int,
        metavar="N",
        help="the world size (in workers) to keep training (default: the stack's "
        "workerMaxReplicas)",
    )
    group.add_argument(
        "--probability",
        type=float,
        default=0.95,
        help="the share of time at least --target-workers should train, between 0 and 1 "
        "(default: %(default)g)",
    )
    group.add_argument(
        "--replacement-minutes",
        type=float,
        default=REPLACEMENT_MIN,
        metavar="M",
        help="minutes from an eviction to the replacement's first step: the last row of "
        "`lab drill`'s table (default: %(default)g, the upper end of the documented 7-11 min)",
    )
    group.add_argument(
        "--replacement-from",
        type=Path,
        metavar="REPORT",
        help="take --replacement-minutes from a drill's report.json: the median of its "
        "replacements' times to the first step at full size (default: not used)",
    )
    group.add_argument(
        "--eviction-rate",
        type=float,
        metavar="PCT",
        help="evictions per node-hour in percent, 0 to 100 (default: the upper end of the "
        "stack region's band, e.g. 15 for 10-15 %%)",
    )
    group.add_argument(
        "--step-seconds",
        type=float,
        metavar="S",
        help="seconds per step at the target world size, to price 1,000 steps: a run's global "
        "batch divided by its samples/s while training, from `lab report` (default: none, "
        "no cost per step)",
    )


def headroom_plan(args: argparse.Namespace, cfg: LabConfig) -> HeadroomPlan:
    """The headroom flags, checked before anything is asked (``HeadroomError`` names one)."""
    target = cfg.job.max_replicas if args.target_workers is None else args.target_workers
    minutes = args.replacement_minutes
    if args.replacement_from is not None:
        minutes, source = _measured_minutes(args.replacement_from)
    elif minutes != REPLACEMENT_MIN:
        source = "--replacement-minutes"
    else:
        source = "the documented estimate (docs/azure.md)"
    rate = args.eviction_rate
    check_inputs(0.0 if rate is None else rate / 100.0, minutes / 60.0, target, args.probability)
    if args.step_seconds is not None and not 0 < args.step_seconds < math.inf:
        raise HeadroomError(f"--step-seconds must be seconds > 0; got {args.step_seconds:g}")
    return HeadroomPlan(target, args.probability, minutes, source, rate, args.step_seconds)


def _measured_minutes(path: Path) -> tuple[float, str]:
    """The median replacement time of a drill's report, in minutes, and where it came from."""
    try:
        report = json.loads(path.read_text())
        times = measured_replacement_s(report) if isinstance(report, dict) else []
    except (OSError, ValueError) as err:
        raise HeadroomError(f"--replacement-from must be a drill's report.json: {err}") from None
    if not times:
        raise HeadroomError(
            f"--replacement-from {path}: no replacement reached full size in that report "
            "(a drill's report.json, from `lab drill` or `lab report --logs`)"
        )
    minutes = statistics.median(times) / 60.0
    return minutes, f"the median of {len(times)} in {path.name}"


def parse_regions(value: str) -> list[str] | None:
    """None for 'all', else the validated list; ``ConfigError`` names the bad one."""
    if value.strip().lower() == "all":
        return None
    regions = [r.strip().lower() for r in value.split(",") if r.strip()]
    bad = [r for r in regions if not REGION.match(r)]
    if not regions or bad:
        raise ConfigError(
            [f"--regions must be 'all' or Azure region names such as westus3,eastus, got {value!r}"]
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
            raise ConfigError([f"--vm-size must be one of {allowed}, got {vm_size!r}"])
        if not args.hours > 0:
            raise ConfigError([f"--hours must be a number of hours > 0, got {args.hours:g}"])
        regions = parse_regions(args.regions)
        plan = headroom_plan(args, cfg)
    except ConfigError as err:
        print(f"error: {'; '.join(err.problems)}", file=sys.stderr)
        return BAD_INPUT
    except HeadroomError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    from lab.azure.clients import Azure, AzureError
    from lab.azure.prices.report import build_report, headroom_section
    from lab.azure.prices.table import format_report

    cache = ApiCache(cache_dir(), refresh=args.refresh)
    try:
        report = build_report(azure or Azure(), cache, cfg, vm_size, regions, args.hours)
    except AzureError as err:
        print(f"error: {err}", file=sys.stderr)
        return PERMANENT
    try:
        report["headroom"] = headroom_section(report, plan)
    except HeadroomError as err:  # the band's rate needs more workers than the model searches
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return OK


def cached_vm_price(vm_size: str, region: str) -> tuple[float | None, float | None] | None:
    """(Spot, on-demand) $/h of a size in a region from the cache of an earlier ``lab prices``
    run, never from the network (a report is built offline); None when not cached."""
    from lab.azure.clients import RETAIL_PRICES, Azure, AzureError
    from lab.azure.prices.retail import RetailPrices

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
