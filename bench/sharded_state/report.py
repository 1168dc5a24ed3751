"""The table of ``python -m bench sharded-state`` and the issue's targets judged on it."""

from __future__ import annotations

from typing import Any

from bench.sharded_state.model import MIB

HEADROOM = 512 * MIB
"""Peak RSS over a rank's RSS without any state: at most its share of the state plus this."""
LOCAL_MAX_S = 2.0
DURABLE_MAX_S = 15.0
BANDWIDTH_SLACK_S = 2.0
FIRST_STEP_MAX_S = 3.0
STEP_RATIO_MAX = 1.03


def _mib(n: float) -> str:
    return f"{n / MIB:8.1f}"


def _over(row: dict[str, Any], peak: str = "peak") -> int:
    """The rank's peak RSS over its RSS without any state (torch, gloo, this program)."""
    return row[peak] - row["runtime"]


def table(results: dict[str, Any]) -> str:
    plan, fsdp2 = results["plan"], results["fsdp2"]
    old, new = plan["world"], plan["restore_world"]
    lines = [
        f"FSDP2, whole state {results['fsdp2_state_bytes'] / MIB:.0f} MiB "
        f"({plan['layers']} x Linear({plan['width']}) + AdamW), world {old}; MiB and s. "
        "peak = peak RSS over the rank's RSS without state; target = share + 512 MiB",
        "store      rank    share     part  save_part  part/bw+2  periodic  peak:part "
        "peak:periodic   target",
    ]
    for kind, found in fsdp2.items():
        bound = results["bandwidth"][kind]
        for row in found["save"]:
            lines.append(
                f"{kind:<10} {row['rank']:>4} {_mib(row['share'])} {_mib(row['part_bytes'])} "
                f"{row['part_s']:>10.2f} {row['part_bytes'] / bound['bytes_per_s'] + 2:>10.2f} "
                f"{row['periodic_s']:>9.2f} {_mib(_over(row, 'part_peak')):>10} "
                f"{_mib(_over(row, 'periodic_peak')):>13} {_mib(row['share'] + HEADROOM)}"
            )
        lines.append(
            f"{kind:<10} single-stream put of {bound['bytes'] / MIB:.0f} MiB: "
            f"{bound['seconds']:.2f} s = {bound['bytes_per_s'] / MIB:.0f} MiB/s"
        )
    lines += [
        "",
        f"Restores at world {new} (from the start of the restore): kill-all = the newest "
        "periodic checkpoint; evict = complete (coordinator) + load of the parts, each node's "
        "own from its disk (kept: files read there); evict-store = every file from the store",
        "store      case         rank    share  complete    loaded  first step  kept     peak   "
        "target",
    ]
    for kind, found in fsdp2.items():
        for case in ("killall", "evict", "evict-store"):
            for row in found[case]:
                lines.append(
                    f"{kind:<10} {case:<11} {row['rank']:>5} {_mib(row['share'])} "
                    f"{row['complete_s']:>9.2f} {row['loaded_s']:>9.2f} "
                    f"{row['first_step_s']:>11.2f} {row['kept_files']:>5} {_mib(_over(row))} "
                    f"{_mib(row['share'] + HEADROOM)}"
                )
    ddp = results["ddp"]
    lines += [
        "",
        f"DDP today, whole state {ddp['state_bytes'] / MIB:.0f} MiB: the single-file emergency "
        "save (SIGTERM -> node-local, -> durable)",
    ]
    for kind, entry in ddp["eviction"].items():
        run = entry["runs"][0]
        lines.append(
            f"{kind:<10} node-local {run['local_s']:6.2f} s  durable {run['durable_s']:6.2f} s"
            + ("" if run["durable"] else "  NOT DURABLE")
        )
    lines.append("DDP restore (agree_on_resume) at world 2: rank, share, s, peak, target (MiB)")
    for row in ddp["restore"]:
        lines.append(
            f"           rank {row['rank']} {_mib(row['share'])} {row['restore_s']:8.2f} s "
            f"{_mib(_over(row))} {_mib(row['share'] + HEADROOM)}"
        )
    steady = results["steady"]
    lines += [
        "",
        f"Step time, world {steady['world']}, {steady['steps']} steps, a sharded save every "
        f"{steady['every']} (median of {steady['pairs']} run(s) each): static "
        f"{steady['static_step_s'] * 1000:.1f} ms, with saves "
        f"{steady['saving_step_s'] * 1000:.1f} ms, ratio {steady['ratio']:.3f}",
        "",
        "target                                               value            met",
    ]
    for t in results["targets"]:
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        lines.append(f"{t['name'] + ' ' + t['target']:<52} {t['value']:<16} {met}")
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the worst rank's value; ``met`` None where the issue only reports."""
    found: list[dict[str, Any]] = []

    def add(name: str, target: str, value: str, met: bool | None) -> None:
        found.append({"name": name, "target": target, "value": value, "met": met})

    for kind, entry in results["fsdp2"].items():
        worst = max(r["part_s"] for r in entry["save"])
        if kind == "directory":
            add("save_part, directory", f"<= {LOCAL_MAX_S:g} s", f"{worst:.2f} s", worst <= 2)
        else:
            bw = results["bandwidth"][kind]["bytes_per_s"]
            slack = max(r["part_s"] - r["part_bytes"] / bw for r in entry["save"])
            add(f"save_part, {kind}", f"<= {DURABLE_MAX_S:g} s", f"{worst:.2f} s", worst <= 15)
            add(
                f"save_part, {kind}",
                "<= part/bw + 2 s",
                f"part/bw + {slack:.2f} s",
                slack <= BANDWIDTH_SLACK_S,
            )
        first = max(r["part_s"] for r in entry["save"]) + max(
            r["first_step_s"] for r in entry["evict"]
        )
        add(
            f"eviction: part + restore + step, {kind}",
            "<= 3 s",
            f"{first:.2f} s",
            first <= FIRST_STEP_MAX_S,
        )
        killall = max(r["first_step_s"] for r in entry["killall"])
        add(f"kill-all restore, {kind}", "report", f"{killall:.2f} s", None)
        for what, rows, peak in (
            ("save_part", entry["save"], "part_peak"),
            ("periodic save", entry["save"], "periodic_peak"),
            ("restore", entry["killall"] + entry["evict"] + entry["evict-store"], "peak"),
        ):
            excess = max(_over(r, peak) - r["share"] for r in rows)
            add(
                f"peak RSS {what}, {kind}",
                "<= share + 512",
                f"share + {excess / MIB:.0f}",
                excess <= HEADROOM,
            )
    excess = max(_over(r) - r["share"] for r in results["ddp"]["restore"])
    add("peak RSS DDP restore (today)", "<= share + 512", f"share + {excess / MIB:.0f}", None)
    ratio = results["steady"]["ratio"]
    add("step time, saves/static", f"<= {STEP_RATIO_MAX}", f"{ratio:.3f}", ratio <= STEP_RATIO_MAX)
    return found
