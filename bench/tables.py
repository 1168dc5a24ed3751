"""The benchmark's results as fixed-width text tables. Pure: dicts in, strings out."""

from __future__ import annotations

from typing import Any

from bench.stages import PHASES

RECOVERY_METRICS = {
    "kill": "downtime: kill -> first step at the new size",
    "evict": "downtime: SIGTERM -> first step at the new size",
    "freeze": "downtime: freeze -> first step at the new size",
    "join": "scale-up: new node -> first step at the larger size",
    "etcd": "etcd down: training paused (membership unchanged)",
}
_PHASE_LABELS = {
    "spawn_and_import_s": "import",
    "inputs_s": "inputs",
    "process_group_s": "pg",
    "build_s": "build",
    "restore_s": "restore",
    "resume_check_s": "check",
    "ddp_s": "ddp",
}


def _rule(header: str) -> str:
    return "-" * len(header)


def format_seconds(summary: dict[str, Any] | None) -> str:
    """``6.5 [6.1-7.0] s``, or ``>= 60 s (no recovery x3)`` when the median is only a bound."""
    if summary is None:
        return "-"
    if summary["at_least"]:
        return f">= {summary['censored_at_s']:g} s (no recovery x{summary['no_recovery']})"
    text = f"{summary['median']:.1f} [{summary['min']:.1f}-{summary['max']:.1f}] s"
    if summary["no_recovery"]:
        text += f" ({summary['no_recovery']} no recovery)"
    return text


def format_count(summary: dict[str, Any] | None) -> str:
    """``3 [0-12]``: median [min-max]."""
    if summary is None:
        return "-"
    return f"{summary['median']:g} [{summary['min']:g}-{summary['max']:g}]"


def _ratio(entry: dict[str, Any]) -> str:
    ratio = entry.get("downtime_ratio")
    if not ratio or ratio["value"] is None:
        return "-"
    return f"{'>=' if ratio['at_least'] else ''}{ratio['value']:.1f}x"


def recovery_table(summary: dict[str, Any], lab_timeout_s: int) -> str:
    """Baseline vs lab per fault kind: median [min-max] over the repetitions."""
    header = f"{'metric':<52} {'baseline (torchrun defaults)':<32} {'lab':<24} {'ratio':>7}"
    lines = [header, _rule(header)]
    for kind, entry in summary.items():
        base, lab = entry.get("baseline"), entry.get("lab")
        down = (base or {}).get("downtime_s"), (lab or {}).get("downtime_s")
        lines.append(
            f"{RECOVERY_METRICS[kind]:<52} {format_seconds(down[0]):<32} "
            f"{format_seconds(down[1]):<24} {_ratio(entry):>7}"
        )
        paused = (base or {}).get("paused_s"), (lab or {}).get("paused_s")
        lines.append(
            f"{'  training paused (last step -> first at new size)':<52} "
            f"{format_seconds(paused[0]):<32} {format_seconds(paused[1]):<24}"
        )
        lost = (base or {}).get("steps_lost"), (lab or {}).get("steps_lost")
        lines.append(
            f"{'  optimiser steps lost (' + kind + ')':<52} {format_count(lost[0]):<32} "
            f"{format_count(lost[1]):<24}"
        )
        if kind == "freeze":
            lines.append(
                f"{'  collective timeout':<52} {'1800 s (gloo default)':<32} "
                f"{str(lab_timeout_s) + ' s (the cluster)':<24}"
            )
        if kind == "etcd":
            restarts = (base or {}).get("restarts"), (lab or {}).get("restarts")
            lines.append(
                f"{'  rounds re-formed (agents restarted)':<52} {format_count(restarts[0]):<32} "
                f"{format_count(restarts[1]):<24}"
            )
    return "\n".join(lines)


def _cell(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def breakdown_table(summary: dict[str, Any]) -> str:
    """Median seconds per stage of a recovery, and the start-up's phases."""
    phases = " ".join(f"{_PHASE_LABELS[p]:>7}" for p in PHASES)
    header = (
        f"{'fault':<7} {'profile':<9} {'detect':>7} {'rdzv':>7} {'start-up':>8} "
        f"{'1st step':>8} {'total':>7} | {phases}"
    )
    lines = [header, _rule(header)]
    for kind, entry in summary.items():
        for name in ("baseline", "lab"):
            if name not in entry:
                continue
            stages, by_phase = entry[name]["stages"], entry[name]["phases"]
            if stages["total_s"] is None:
                down = entry[name]["downtime_s"]
                note = format_seconds(down) if down and down["no_recovery"] else "no data"
                lines.append(f"{kind:<7} {name:<9} {note}")
                continue
            lines.append(
                f"{kind:<7} {name:<9} {_cell(stages['detect_s']):>7} "
                f"{_cell(stages['rendezvous_s']):>7} {_cell(stages['startup_s']):>8} "
                f"{_cell(stages['first_step_s']):>8} {_cell(stages['total_s']):>7} | "
                + " ".join(f"{_cell(by_phase[p]):>7}" for p in PHASES)
            )
    return "\n".join(lines)


def steady_table(steady: dict[str, Any]) -> str:
    """Median and mean step time of the elastic and the static run, and their ratio."""
    header = f"{'run':<44} {'median step':>12} {'mean step':>10} {'steps':>6}"
    lines = [header, _rule(header)]
    labels = {
        "elastic": "lab: etcd, 2 agents, checkpoints + emergency",
        "static": "torchrun --standalone, checkpoints off",
    }
    for mode, label in labels.items():
        m = steady[mode]
        lines.append(
            f"{label:<44} {m['median_step_s']:>10.4f} s {m['mean_step_s']:>8.4f} s {m['steps']:>6}"
        )
    lines.append(
        f"{'ratio elastic / static (pooled)':<44} {steady['median_ratio']:>12.3f} "
        f"{steady['mean_ratio']:>10.3f}"
    )
    pairs = ", ".join(f"{r:.3f}" for r in steady["pair_ratios"])
    lines.append(
        f"{'ratio per back-to-back pair, median':<44} {steady['pair_ratio_median']:>12.3f}"
        f"   ({pairs})"
    )
    lines.append("CPU seconds per step by process (the machine has to share its cores):")
    for mode in labels:
        cpu = steady[mode]["cpu_s_per_step"]
        lines.append(f"  {mode:<8} " + ", ".join(f"{role} {cpu[role]:.4f}" for role in cpu))
    return "\n".join(lines)


def stall_table(stall: dict[str, Any]) -> str:
    """Per model: step time and how long each way of saving blocks the loop."""
    header = (
        f"{'model':<22} {'ckpt MB':>8} {'step s':>8} {'sync stall':>18} {'lab stall':>18} "
        f"{'bg write s':>10}"
    )
    lines = [header, _rule(header)]
    for m in stall["models"]:
        name = f"{m['model']} ({m['model_width']}x{m['model_blocks']})"
        sync = f"{m['sync_stall_s']:.4f} s {m['sync_fraction_of_step']:>6.1%}"
        lab = f"{m['lab_stall_s']:.4f} s {m['lab_fraction_of_step']:>6.2%}"
        lines.append(
            f"{name:<22} {m['checkpoint_bytes'] / 1e6:>8.1f} {m['step_s']:>8.3f} "
            f"{sync:>18} {lab:>18} {m['lab_background_write_s']:>10.4f}"
        )
    return "\n".join(lines)


def targets_table(targets: list[dict[str, Any]]) -> str:
    """Each target, the measured value, met or missed, and why when missed."""
    header = f"{'target':<58} {'wanted':<50} {'measured':<22} result"
    lines = [header, _rule(header)]
    for t in targets:
        result = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"{t['name']:<58} {t['target']:<50} {t['value']:<22} {result}")
        if t["why"]:
            lines.append(f"    why: {t['why']}")
    return "\n".join(lines)
