"""``lab prices`` as the table a human reads: the ranked regions, the stack's headline, the
on-demand fallback's price beside Spot's, and the idle cost."""

from __future__ import annotations

from lab.azure.prices.report import NOT_COUNTED
from lab.azure.prices.retail import HOURS_PER_MONTH


def _money(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"${value:,.{digits}f}"


def format_report(report: dict) -> str:
    """The table a human reads; ``report`` is what ``--json`` prints."""
    rows = report["regions"]
    hours, workers, fallback = report["hours"], report["workers"], report.get("fallback")
    header: tuple[str, ...] = ("#", "region", "Spot $/h", "on-demand $/h", "saving")
    header += ("eviction/h", f"{hours:g} h × {workers} Spot")
    if fallback:
        header += (f"{hours:g} h × {fallback['max_nodes']} on-demand",)
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
            + (
                (_money(_times(row["on_demand"], hours * fallback["max_nodes"]), 2),)
                if fallback
                else ()
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        f"{report['vm_size']} ({report['gpus']}× {report['gpu_model']}, {report['vcpus']} vCPUs), "
        f"Linux, USD list prices; stack {report['stack']}",
        _headline(report),
        *([_fallback_line(fallback, hours)] if fallback else []),
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
    if report.get("headroom"):
        lines += headroom_lines(report["headroom"], report["stack_region"])
    lines.append(f"Prices taken {report['prices_taken']}; eviction bands {report['bands_taken']}.")
    return "\n".join(lines)


def headroom_lines(room: dict, region: str) -> list[str]:
    """The headroom recommendation for the stack's region, and what 1,000 steps cost."""
    target, share = room["target"], f"{room['probability']:.0%}"
    replacement = f"replacement {room['replacement_min']:g} min, {room['replacement_source']}"
    if "note" in room:
        return [
            f"Headroom in {region} to keep {target} training {share} of the time: {room['note']}."
        ]
    workers = room["workers"]
    lines = [
        f"Headroom in {region} (eviction {room['eviction_rate_pct']:g} % a node-hour, "
        f"{room['rate_source']}; {replacement}):",
        f"  a worker is missing {room['unavailability']:.1%} of the time; with no headroom "
        f"{target} train {room['without_headroom']:.1%} of the time.",
        f"  To keep {target} training {share} of the time, ask for {workers}: workerMaxReplicas "
        f"{workers} (the GPU pool follows it; or gpuMaxNodes {workers}).",
        f"  With {workers}: {target} or more train {room['achieved']:.1%} of the time, "
        f"{room['expected_missing']:.2f} missing on average.",
    ]
    if room.get("step_s") is not None:
        lines.append(
            f"  1,000 steps ({room['step_s']:g} s a step at {target} workers): Spot with "
            f"{workers} {_money(room['spot_usd_per_1000_steps'], 2)} in "
            f"{room['spot_hours_per_1000_steps']:.2f} h; on demand with {target} "
            f"{_money(room['on_demand_usd_per_1000_steps'], 2)} in "
            f"{room['on_demand_hours_per_1000_steps']:.2f} h."
        )
    lines.append(
        "  Assumes evictions independent of each other; a wave (many Spot VMs reclaimed at "
        'once) is not covered: docs/azure.md, "Headroom, not spares".'
    )
    return lines


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


def _times(price: float | None, factor: float) -> float | None:
    return None if price is None else price * factor


def _fallback_line(fallback: dict, hours: float) -> str:
    """The on-demand fallback's price beside Spot's, in the stack's region."""
    ratio = fallback["times_spot"]
    beside = f", {ratio:g}× the Spot price" if ratio else ""
    return (
        f"On-demand fallback (onDemandMaxNodes {fallback['max_nodes']}): "
        f"{_money(fallback['on_demand_usd_per_h'], 4)}/h a node in {fallback['region']}{beside}; "
        f"{hours:g} h × {fallback['max_nodes']} on demand: {_money(fallback['run_cost'], 2)}."
    )
