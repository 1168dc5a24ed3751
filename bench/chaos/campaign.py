"""A chaos campaign: N random schedules, each checked against every invariant.

Schedule ``i`` of a campaign with seed ``S`` is drawn from seed ``S + i``, so the line it prints
names the seed that replays it alone (``--seed S+i --schedules 1``). The final parameters of
every schedule are compared with one uninterrupted run of the same training (float64, one
plain process: a world size of its own, which float64 makes irrelevant to ~1e-15).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.chaos.invariants import INVARIANTS
from bench.chaos.plan import ChaosPlan
from bench.chaos.schedule import random_schedule
from bench.chaos.session import final_state, run_schedule
from lab.local.etcd_server import find_etcd_binary
from lab.local.session import REPO_ROOT
from training.data.cifar10 import write_synthetic_cifar10


class ReferenceRunError(RuntimeError):
    """The uninterrupted run failed: nothing to compare with."""


def reference_parameters(
    plan: ChaosPlan, data_dir: Path, work: Path, python: str
) -> dict[str, Any]:
    """The final parameters of the same training, uninterrupted (no pacing: it changes no
    number)."""
    args = plan.train().args(str(data_dir)) + [
        f"--checkpoint-uri={work / 'checkpoints'}",
        f"--local-dir={work / 'local'}",
        "--min-step-time-s=0",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TRAIN_"))}
    result = subprocess.run(
        [python, "-m", "training.train", *args],
        cwd=REPO_ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    step, params = final_state(work / "checkpoints")
    if result.returncode != 0 or step != plan.max_steps or params is None:
        raise ReferenceRunError(f"the uninterrupted run failed:\n{result.stderr[-3000:]}")
    return params


def describe(result: dict[str, Any], index: int, total: int) -> str:
    """One line per schedule, with the seed that replays it."""
    bad = len(result["violations"])
    pause = result["worst_pause_s"]
    head = (
        f"[{index + 1:>3}/{total}] seed {result['seed']}: {len(result['faults'])} faults, "
        f"{result['status']}, {bad} violation{'s' * (bad != 1)}, "
        f"worst pause {pause if pause is not None else '-'} s, {result['steps_lost']} steps lost"
    )
    lines = [head, f"      {result['described']}"]
    lines += [f"      VIOLATION {v['invariant']}: {v['detail']}" for v in result["violations"]]
    lines += [f"      excused {e['invariant']}: {e['detail']}" for e in result["excused"]]
    if bad:
        lines.append(f"      replay: python -m bench chaos --seed {result['seed']} --schedules 1")
    return "\n".join(lines)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's figures: schedules, faults, violations by invariant, pauses."""
    faults = [len(r["faults"]) for r in results]
    pauses = [r["worst_pause_s"] for r in results if r["worst_pause_s"] is not None]
    by_invariant = Counter(v["invariant"] for r in results for v in r["violations"])
    kinds = Counter(f["kind"] for r in results for f in r["faults"])
    landed = Counter(a["kind"] for r in results for a in r["actions"] if a.get("landed") is True)
    missed = Counter(a["kind"] for r in results for a in r["actions"] if a.get("landed") is False)
    return {
        "schedules": len(results),
        "faults_per_schedule": {
            "mean": round(statistics.mean(faults), 2) if faults else None,
            "min": min(faults, default=None),
            "max": max(faults, default=None),
        },
        "faults_by_kind": dict(sorted(kinds.items())),
        "triggered_landed": dict(sorted(landed.items())),
        "not_landed": dict(sorted(missed.items())),
        "violations": sum(by_invariant.values()),
        "violations_by_invariant": {name: by_invariant.get(name, 0) for name in INVARIANTS},
        "schedules_with_violations": sum(1 for r in results if r["violations"]),
        "excused": sum(len(r["excused"]) for r in results),
        "steps_lost": sum(r["steps_lost"] for r in results),
        "worst_pause_s": {
            "median": round(statistics.median(pauses), 2) if pauses else None,
            "max": max(pauses, default=None),
        },
    }


def run_campaign(
    plan: ChaosPlan,
    *,
    seed: int,
    schedules: int,
    out: Path,
    python: str = sys.executable,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``schedules`` schedules from ``seed``; everything ``chaos.json`` holds."""
    plan.validate()
    if schedules < 1:
        raise ValueError(f"--schedules must be >= 1, got {schedules}")
    binary = find_etcd_binary()
    started = time.monotonic()
    data_dir, work = out / "data", out / "reference"
    train = plan.train()
    write_synthetic_cifar10(
        data_dir, train_records=train.train_records, test_records=train.test_records
    )
    say("the uninterrupted run (the reference trajectory) ...")
    reference = reference_parameters(plan, data_dir, work, python)
    results: list[dict[str, Any]] = []
    interrupted = False
    try:
        for index in range(schedules):
            schedule = random_schedule(
                seed + index, plan.nodes, plan.faults, plan.nproc_per_node, plan.partitions
            )
            result = run_schedule(
                schedule,
                plan,
                data_dir=data_dir,
                out=out / "schedules" / f"seed-{schedule.seed}",
                reference=reference,
                etcd_binary=binary,
                python=python,
            )
            if result["status"] == "interrupted":  # the lab's runner took the Ctrl-C: not a result
                raise KeyboardInterrupt
            results.append(result)
            say(describe(result, index, schedules))
    except KeyboardInterrupt:  # a long campaign stopped early still reports what it ran
        interrupted = True
        say(f"interrupted after {len(results)} of {schedules} schedules")
    return {
        "interrupted": interrupted,
        "schedules_planned": schedules,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "plan": plan.as_dict(),
        "seed": seed,
        "summary": summarize(results),
        "schedules": results,
        "wall_s": round(time.monotonic() - started, 1),
    }


def summary_table(
    summary: dict[str, Any], plan: dict[str, Any], seed: int, planned: int | None = None
) -> str:
    """The campaign's table, as docs/benchmarks.md shows it; ``planned``: the schedules asked
    for, when the campaign was interrupted before all of them ran."""
    stopped = f" (interrupted: {planned} planned)" if planned else ""
    per = summary["faults_per_schedule"]
    pause = summary["worst_pause_s"]
    low, high = plan["faults"]
    header = (
        f"{summary['schedules']} schedules from seed {seed}{stopped}: {plan['nodes']} nodes (min "
        f"{plan['min_nodes']}) of {'/'.join(map(str, plan.get('nproc_per_node', [1])))} "
        f"processes, {low}-{high} faults each, 0-3 s apart, {plan['max_steps']} "
        f"steps in float64, stop deadline {plan['stop_deadline_s']:g} s, "
        f"grace {plan['grace_s']:g} s"
    )
    columns = (
        "schedules",
        "faults/schedule",
        "violations",
        "excused",
        "steps lost",
        "worst pause s",
    )
    row = (
        str(summary["schedules"]),
        f"{per['mean']} [{per['min']}-{per['max']}]",
        str(summary["violations"]),
        str(summary["excused"]),
        str(summary["steps_lost"]),
        f"median {pause['median']}, max {pause['max']}",
    )
    widths = [max(len(c), len(v)) for c, v in zip(columns, row, strict=True)]
    lines = [
        header,
        "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)),
        "  ".join("-" * w for w in widths),
        "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)),
        "violations by invariant: "
        + ", ".join(f"{k} {v}" for k, v in summary["violations_by_invariant"].items()),
        "faults by kind: " + ", ".join(f"{k} {v}" for k, v in summary["faults_by_kind"].items()),
        "triggered faults that landed: "
        + (", ".join(f"{k} {v}" for k, v in summary["triggered_landed"].items()) or "none")
        + "; not landed: "
        + (", ".join(f"{k} {v}" for k, v in summary["not_landed"].items()) or "none"),
    ]
    return "\n".join(lines)
