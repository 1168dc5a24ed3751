"""The report as text: the terminal table, each replacement's arrival, the cost of a run."""

from __future__ import annotations

from typing import Any

from lab.report.replacement import format_steps


def _cell(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def format_table(report: dict[str, Any]) -> str:
    """The report as a fixed-width table for the terminal."""
    start = report["start_ts"]
    header = (
        f"{'#':>2}  {'fault':<36} {'at':>6} {'detect':>6} {'resume':>6} {'d->r':>5} "
        f"{'down s':>6} {'pause':>5} {'lost':>4} {'world':>6} {'source':<8} ok"
    )
    lines = [header, "-" * len(header)]
    for f in report["faults"]:
        lines.append(
            f"{f['index']:>2}  {f['description'][:36]:<36} "
            f"{_cell(f['injected_at'] - start, '{:.1f}'):>6} "
            f"{_cell(f['detection_s'], '+{:.1f}'):>6} "
            f"{_cell(f['resume_s'], '+{:.1f}'):>6} "
            f"{_cell(f['detect_to_resume_s'], '{:.1f}'):>5} "
            f"{_cell(f['downtime_s'], '{:.1f}'):>6} {_cell(f['paused_s'], '{:.1f}'):>5} "
            f"{_cell(f['steps_lost']):>4} "
            f"{_cell(f['world_size_before'])}->{_cell(f['world_size_after']):<3} "
            f"{_cell(f['resume_source']):<8} "
            f"{'yes' if f['recovered'] else ('SPLIT' if f.get('two_groups') else 'NO')}"
        )
    run = report["run"]
    lines.append("-" * len(header))
    lines.append(
        f"step {run['final_step']}/{run['max_steps']}, final loss {_cell(run['final_loss'])}, "
        f"{run['samples_per_s']} samples/s overall "
        f"({_cell(run['training_samples_per_s'])} while training), "
        f"{run['total_downtime_s']:.1f} s to full size ({run['total_paused_s']:.1f} s without a "
        f"step) in {run['wall_s']:.0f} s, "
        f"{run['faults_recovered']}/{run['faults_planned']} faults recovered"
    )
    if (seen := run.get("validation")) is not None:
        lines.append(
            f"validation loss {seen['first_loss']:.4f} at step {seen['first_step']} -> "
            f"{seen['last_loss']:.4f} at step {seen['last_step']} "
            f"({seen['evaluations']} evaluations)"
            + (f"; sampled: {seen['last_sample']!r}" if seen.get("last_sample") else "")
        )
    return "\n".join(lines)


def format_world_sizes(report: dict[str, Any]) -> str:
    """One line: the time at each world size, and the training the missing workers cost."""
    sizes = report.get("world_sizes")
    if not sizes:
        return ""
    total = sum(sizes["seconds"].values()) + sizes["no_step_s"]

    def share(spent: float) -> str:  # a run logged within one clock tick has no time at all
        return f"{spent / total:.0%}" if total else "-"

    parts = [
        f"{world} for {spent:.1f} s ({share(spent)})"
        for world, spent in sorted(sizes["seconds"].items(), key=lambda item: -int(item[0]))
    ]
    parts.append(f"no step {sizes['no_step_s']:.1f} s ({share(sizes['no_step_s'])})")
    lost = sizes["lost_to_missing_s"]
    return (
        f"world size: {', '.join(parts)}; missing workers cost {lost:.1f} s of training at "
        f"full size {sizes['full_world_size']} ({_cell(sizes['lost_share'], '{:.0%}')} of the "
        f"time with a step), {_cell(sizes['mean_missing'], '{:.2f}')} ranks missing on average"
    )


def format_arrivals(report: dict[str, Any]) -> str:
    """One line per fault with a replacement: how long it took and where the time went."""
    lines = []
    for fault in report["faults"]:
        if fault.get("replacement_steps"):
            lines.append(format_steps(fault))
            continue
        arrival = fault.get("arrival")
        if not arrival:
            continue
        origin = fault["injected_at"]
        stages = [
            f"{name} +{arrival[key] - origin:.0f} s"
            for key, name in (
                ("scale_up_at", "scale-up"),
                ("node_registered_at", "node"),
                ("scheduled_at", "scheduled"),
                ("image_pulled_at", "image"),
                ("started_at", "started"),
                ("joined_at", "joined"),
            )
            if arrival.get(key) is not None
        ]
        total = _cell(arrival["arrival_s"], "{:.0f} s")
        head = f"fault {fault['index']}: replacement {arrival['pod']} in {total}: "
        lines.append(head + ", ".join(stages))
    return "\n".join(lines)


def format_cost(cost: dict[str, Any]) -> str:
    """The GPU node-hours at Spot and on demand, what they cost, and each move's saving."""
    spot, demand = cost["spot_usd"], cost["on_demand_usd"]
    lines = [
        f"GPU node-hours {cost['gpu_node_hours']:.3f} ({cost['spot_node_hours']:.3f} Spot, "
        f"{cost['on_demand_node_hours']:.3f} on demand): {_cell(spot, '${:.2f}')} at Spot + "
        f"{_cell(demand, '${:.2f}')} on demand = {_cell(cost['total_usd'], '${:.2f}')}; all on "
        f"demand {_cell(cost['all_on_demand_usd'], '${:.2f}')} ({cost['price_source']})"
    ]
    for move in cost.get("moves") or []:
        lines.append(
            f"move {move['index']}: {move['pod']} back on Spot ({move['to_node']}) for "
            f"{move['spot_hours']:.3f} h, saves {_cell(move['saves_usd_per_h'], '${:.3f}')}/h: "
            f"{_cell(move['saved_usd'], '${:.2f}')} saved"
        )
    return "\n".join(lines)


def format_extension(report: dict[str, Any]) -> str:
    """A lab run's faults that fired late, and the step its end was moved to."""
    lines = [
        f"fault {late['index']} ({late['description']}) fired late, at step "
        f"{late['injected_at_step']}: from step {late['waited_from_step']} it waited for the "
        "job to settle after the fault before"
        for late in report.get("late_faults") or []
    ]
    run = report["run"]
    if run.get("extended_to_step") is not None:
        lines.append(
            f"the run extended to step {run['extended_to_step']} (max_steps {run['max_steps']}): "
            "the lab keeps the end ahead while a fault is still to fire or to settle"
        )
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    """The table, then the replacements' arrivals and the cost when the report has them."""
    parts = [
        format_table(report),
        format_world_sizes(report),
        format_extension(report),
        format_arrivals(report),
    ]
    if report.get("cost"):
        parts.append(format_cost(report["cost"]))
    return "\n".join(p for p in parts if p)
