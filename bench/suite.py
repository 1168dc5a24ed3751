"""The whole benchmark: checkpoint stall, steady state, recovery, then the chaos campaign; one
results dict.

``BenchConfig`` says what to run (``default_config`` and ``smoke_config`` are the two
presets); ``run_bench`` runs it and returns everything ``bench.json`` holds. ``report_text``
turns the results into the printed tables.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.chaos.campaign import run_campaign, summary_table
from bench.chaos.plan import ChaosPlan
from bench.checkpoint_stall import StallModel, StallPlan, measure_checkpoint_stall
from bench.commit_deadline import CommitPlan, commit_table, commit_targets, measure_commit_deadline
from bench.profiles import PROFILE_NAMES, baseline_profile, lab_profile, profile
from bench.recovery import measure_recovery
from bench.scenarios import FAULT_KINDS, RecoveryPlan, SteadyPlan
from bench.steady_state import measure_steady_state
from bench.tables import breakdown_table, recovery_table, stall_table, steady_table, targets_table
from bench.targets import recovery_targets, stall_targets, steady_target
from lab.local import netns
from training.data.cifar10 import write_synthetic_cifar10

DATA_RECORDS = 4096
"""Synthetic training records every run reads (the data never limits a few hundred steps)."""


@dataclass(frozen=True)
class BenchConfig:
    """What one ``python -m bench`` runs."""

    reps: int = 3
    kinds: tuple[str, ...] = FAULT_KINDS
    recovery: RecoveryPlan = field(default_factory=RecoveryPlan)
    steady: SteadyPlan = field(default_factory=SteadyPlan)
    steady_pairs: int = 4
    stall: StallPlan = field(default_factory=StallPlan)
    commit: CommitPlan = field(default_factory=CommitPlan)
    chaos: ChaosPlan = field(default_factory=ChaosPlan)
    chaos_schedules: int = 200
    """Schedules of the chaos campaign (``python -m bench chaos``); 0 leaves it out."""
    chaos_seed: int = 1
    smoke: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the setting that is out of range."""
        if self.reps < 1:
            raise ValueError(f"--reps must be >= 1, got {self.reps}")
        unknown = [k for k in self.kinds if k not in FAULT_KINDS]
        if unknown or not self.kinds:
            raise ValueError(
                f"--kinds: {','.join(unknown) or 'empty'} is not a fault kind; "
                f"allowed: {','.join(FAULT_KINDS)}"
            )
        if self.steady_pairs < 1:
            raise ValueError(f"--steady-pairs must be >= 1, got {self.steady_pairs}")
        self.recovery.validate()
        self.steady.validate()
        self.stall.validate()
        self.commit.validate()
        if self.chaos_schedules < 0:
            raise ValueError(f"--chaos-schedules must be >= 0, got {self.chaos_schedules}")
        self.chaos.validate()


def default_config() -> BenchConfig:
    """The full benchmark: about 25 minutes on two cores, and the chaos campaign's 200
    schedules about two hours more (``--chaos-schedules`` sets how many)."""
    return BenchConfig()


def smoke_config() -> BenchConfig:
    """One repetition of one fault kind, tiny runs: proves the pipeline, not the numbers.

    The freeze covers both outcomes: the lab recovers; torchrun's defaults do not within the
    (short) cap, so the "no recovery" path is exercised too.
    """
    return BenchConfig(
        reps=1,
        kinds=("freeze",),
        recovery=RecoveryPlan(nodes=2, fault_at_step=25, recovery_cap_s=30.0),
        steady=SteadyPlan(
            max_steps=25,
            warmup_steps=5,
            checkpoint_every_steps=10,
            model_width=8,
            model_blocks=1,
            global_batch_size=32,
            micro_batch_size=16,
        ),
        steady_pairs=1,
        stall=StallPlan(models=(StallModel("lab default", 16, 2),), steps=2, saves=2),
        commit=CommitPlan(state_mb=16, reps=1),
        chaos=ChaosPlan(faults=(2, 3), max_steps=80, nproc_per_node=(1,)),  # one proc: quick
        chaos_schedules=1,
        smoke=True,
    )


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def chaos_plan(plan: ChaosPlan, say: Callable[[str], None]) -> ChaosPlan:
    """``plan``, without partitions where network namespaces cannot be made: they need root,
    and the rest of the benchmark does not."""
    reason = netns.unavailable() if plan.partitions else None
    if reason is None:
        return plan
    say(f"chaos: no partitions ({reason})")
    return dataclasses.replace(plan, partitions=False)


def run_bench(
    config: BenchConfig,
    out_dir: Path,
    *,
    python: str = sys.executable,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every part of ``config``; sessions' logs go under ``out_dir``. The results."""
    config.validate()
    started = time.monotonic()
    results: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "smoke": config.smoke,
        "machine": machine(),
        "profiles": {name: profile(name).as_dict() for name in PROFILE_NAMES},
    }
    with tempfile.TemporaryDirectory(prefix="bench-data-") as data:
        data_dir = Path(data)
        write_synthetic_cifar10(data_dir, train_records=DATA_RECORDS, test_records=128)
        say("checkpoint stall (in-process) ...")
        results["checkpoint_stall"] = measure_checkpoint_stall(config.stall, data_dir)
        results["commit_deadline"] = measure_commit_deadline(config.commit, say)
        say("steady state (elastic vs static, interleaved) ...")
        results["steady_state"] = measure_steady_state(
            config.steady,
            lab_profile(),
            pairs=config.steady_pairs,
            out_dir=out_dir / "steady",
            data_dir=data_dir,
            python=python,
            on_run=say,
        )
        say(f"recovery: {config.reps} reps x {', '.join(config.kinds)} x baseline/lab ...")
        results["recovery"] = measure_recovery(
            config.recovery,
            kinds=config.kinds,
            reps=config.reps,
            out_dir=out_dir / "sessions",
            data_dir=data_dir,
            python=python,
            on_run=say,
        )
    if config.chaos_schedules:
        say(f"chaos: {config.chaos_schedules} schedule(s) of overlapping faults ...")
        campaign = run_campaign(
            chaos_plan(config.chaos, say),
            seed=config.chaos_seed,
            schedules=config.chaos_schedules,
            out=out_dir / "chaos",
            python=python,
            say=say,
        )
        (out_dir / "chaos" / "chaos.json").write_text(json.dumps(campaign, indent=1) + "\n")
        # bench.json keeps the figures; every schedule's record stays in chaos/chaos.json.
        results["chaos"] = {k: v for k, v in campaign.items() if k != "schedules"}
    results["targets"] = (
        recovery_targets(results["recovery"]["summary"], lab_profile())
        + [steady_target(results["steady_state"])]
        + stall_targets(results["checkpoint_stall"])
        + commit_targets(results["commit_deadline"])
    )
    results["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    results["wall_s"] = round(time.monotonic() - started, 1)
    return results


def _recovery_note(plan: dict[str, Any]) -> str:
    nodes = plan["nodes"]
    return (
        f"each run: one session, {nodes} nodes, model {plan['model_width']}x"
        f"{plan['model_blocks']}, batch {plan['global_batch_size']}, checkpoint every "
        f"{plan['checkpoint_every_steps']} steps, fault at step {plan['fault_at_step']} on "
        f"node-0 (rank 0); join goes {nodes - 1} -> {nodes} = max nodes, so no last call; "
        f"no recovery = not settled {plan['recovery_cap_s']:g} s after the fault"
    )


def report_text(results: dict[str, Any]) -> str:
    """Every table: recovery, its breakdown, steady state, checkpoint stall, targets."""
    baseline, lab = baseline_profile(), lab_profile()
    recovery = results["recovery"]
    load = results["machine"]["load_average"]
    sections = [
        f"Elastic spot lab vs plain torchrun, {recovery['plan']['reps']} rep(s), "
        f"{results['machine']['cpus']} CPUs, torch {results['machine']['torch']}, "
        f"load average {load[0]:.2f} at start, {results['wall_s']:.0f} s in all",
        f"baseline: {baseline.description} (rdzv {baseline.rendezvous.conf_arg()}, "
        f"emergency saves off, collective timeout {baseline.collective_timeout_s} s, "
        f"launcher {baseline.launcher})",
        f"lab:      rdzv {lab.rendezvous.conf_arg()}, emergency saves on, "
        f"collective timeout {lab.collective_timeout_s} s, launcher {lab.launcher}",
        "",
        "Recovery, median [min-max] over the repetitions",
        recovery_table(recovery["summary"], lab.collective_timeout_s),
        _recovery_note(recovery["plan"]),
        "",
        "Where the time goes (median seconds per stage; start-up phases on the right)",
        breakdown_table(recovery["summary"]),
        "detect: fault -> first peer_failure (or emergency_save); rdzv: -> new worker process"
        " started (old workers exit, the dead node's heartbeat expires, last call, spawn);"
        " start-up: -> ready; 1st step: -> first metrics line at the new size",
        "",
        "Steady state, same model and world size, interleaved runs",
        steady_table(results["steady_state"]),
        "",
        "Checkpoint stall per save, in-process, local directory",
        stall_table(results["checkpoint_stall"]),
        "",
        "An eviction's save, SIGTERM -> node-local copy and -> durable commit, median [max]",
        commit_table(results["commit_deadline"]),
        "",
        "Targets",
        targets_table(results["targets"]),
    ]
    if "chaos" in results:
        chaos = results["chaos"]
        sections += [
            "",
            "Chaos campaign",
            summary_table(
                chaos["summary"],
                chaos["plan"],
                chaos["seed"],
                chaos["schedules_planned"] if chaos["interrupted"] else None,
            ),
        ]
    return "\n".join(sections)
