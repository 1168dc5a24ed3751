"""Steady-state step time: the lab's elastic run against a static ``torchrun --standalone``.

Elastic: a lab session without faults (etcd rendezvous, ``nodes`` torchrun agents, periodic
durable checkpoints and emergency saves on). Static: one ``torchrun --standalone
--nproc-per-node nodes`` of the same program and model, checkpoints off. The same world size,
one thread per worker in both. Runs alternate (elastic, static, elastic, static, ...) so slow
drift of the machine's load hits both alike; the first ``warmup_steps`` of each are dropped.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cpu_profile import CpuProfile
from bench.profiles import Profile
from bench.scenarios import SteadyPlan, steady_scenario, steady_train
from lab.local import process_tree
from lab.local.session import REPO_ROOT, SessionOptions, run_session
from lab.report.node_logs import read_records
from training.elastic.launch import TRAIN_MODULE
from training.records import METRICS, Record

STATIC_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0


class BenchRunError(RuntimeError):
    """A benchmark run did not complete; the message says which and why."""


def static_command(plan: SteadyPlan, train_args: list[str], python: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node N --module training.train ARGS``."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={plan.nodes}",
        "--module",
        TRAIN_MODULE,
        *train_args,
    ]


def run_static(
    plan: SteadyPlan, profile: Profile, out: Path, data_dir: Path, python: str
) -> list[Record]:
    """One static run; its records. Raises BenchRunError when it fails or hangs."""
    train = steady_train(plan, profile, checkpoints=False)
    out.mkdir(parents=True, exist_ok=False)
    with tempfile.TemporaryDirectory(prefix="bench-static-") as work:
        env = {
            **os.environ,
            "TRAIN_CHECKPOINT_URI": str(Path(work) / "checkpoints"),
            "TRAIN_LOCAL_DIR": str(Path(work) / "local"),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",  # as in a lab node: one thread per worker
        }
        # SIGTERM when the benchmark dies, even of SIGKILL: torchrun drains its workers.
        command = process_tree.dying_with_this_process(
            static_command(plan, train.args(str(data_dir)), python), python
        )
        with open(out / "static.jsonl", "wb") as stdout, open(out / "static.log", "wb") as stderr:
            process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=env,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                code = process.wait(timeout=STATIC_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                if process.poll() is None:
                    process_tree.terminate_tree(process.pid, STOP_GRACE_S)
                    process.wait()
    if code != 0:
        tail = (out / "static.log").read_text(errors="replace")[-2000:]
        raise BenchRunError(f"the static torchrun run ended with {code}:\n{tail}")
    return read_records(out)


def run_elastic(
    plan: SteadyPlan, profile: Profile, out: Path, data_dir: Path, python: str
) -> list[Record]:
    """One fault-free lab session; its records. Raises BenchRunError unless it finished."""
    options = SessionOptions(out_dir=out, data_dir=data_dir, python=python)
    report = run_session(steady_scenario(plan, profile), options, None)
    if report["outcome"]["status"] != "finished":
        raise BenchRunError(f"the elastic run did not finish: {report['outcome']['message']}")
    return read_records(out / "nodes")


def step_times(records: list[Record], world_size: int, warmup_steps: int) -> list[float]:
    """``step_time_s`` of every metrics line at ``world_size`` after ``warmup_steps``."""
    return [
        float(r["step_time_s"])
        for r in records
        if r["kind"] == METRICS and r["world_size"] == world_size and r["step"] > warmup_steps
    ]


def _steps_run(records: list[Record]) -> int:
    """Optimiser steps the run logged (a step redone after a restart counts again)."""
    return sum(1 for r in records if r["kind"] == METRICS)


def _cpu_per_step(runs: list[dict[str, Any]]) -> dict[str, float]:
    steps = sum(run["steps_run"] for run in runs)
    roles = {role for run in runs for role in run["cpu_s"]}
    return {
        role: round(sum(run["cpu_s"].get(role, 0.0) for run in runs) / max(steps, 1), 4)
        for role in sorted(roles)
    }


def summarize_steady(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled median and mean step time per mode, CPU seconds per step by role, the ratio."""
    modes: dict[str, Any] = {}
    for mode in ("elastic", "static"):
        mine = [run for run in runs if run["mode"] == mode]
        samples = [t for run in mine for t in run["step_times_s"]]
        if not samples:
            raise BenchRunError(f"no {mode} step times after warm-up")
        modes[mode] = {
            "median_step_s": round(statistics.median(samples), 5),
            "mean_step_s": round(statistics.fmean(samples), 5),
            "min_step_s": round(min(samples), 5),
            "max_step_s": round(max(samples), 5),
            "steps": len(samples),
            # Everything but the workers competes with them for the machine's cores.
            "cpu_s_per_step": _cpu_per_step(mine),
        }
    elastic, static = modes["elastic"], modes["static"]
    ratios = pair_ratios(runs)
    return {
        **modes,
        "median_ratio": round(elastic["median_step_s"] / static["median_step_s"], 4),
        # The mean includes the steps that paid for a checkpoint snapshot.
        "mean_ratio": round(elastic["mean_step_s"] / static["mean_step_s"], 4),
        # Each pair ran back to back: its ratio is what slow drift of the machine spares.
        "pair_ratios": ratios,
        "pair_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
    }


def pair_ratios(runs: list[dict[str, Any]]) -> list[float]:
    """Per pair, the elastic run's median step time over the static run's."""
    ratios = []
    for pair in sorted({run["pair"] for run in runs}):
        medians = {
            run["mode"]: statistics.median(run["step_times_s"])
            for run in runs
            if run["pair"] == pair and run["step_times_s"]
        }
        if len(medians) == 2:
            ratios.append(round(medians["elastic"] / medians["static"], 4))
    return ratios


def measure_steady_state(
    plan: SteadyPlan,
    profile: Profile,
    *,
    pairs: int,
    out_dir: Path,
    data_dir: Path,
    python: str = sys.executable,
    on_run: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """``pairs`` x (elastic, static) runs, interleaved; their step times and the ratio."""
    plan.validate()
    if pairs < 1:
        raise ValueError(f"steady-state pairs must be >= 1, got {pairs}")
    runs: list[dict[str, Any]] = []
    for pair in range(pairs):
        order = (("elastic", run_elastic), ("static", run_static))
        # Alternate which goes first, so a machine that slows down or speeds up over the
        # benchmark does not always favour the same mode.
        for mode, run in order if pair % 2 == 0 else tuple(reversed(order)):
            with CpuProfile() as cpu:
                records = run(plan, profile, out_dir / f"{mode}-{pair}", data_dir, python)
            times = step_times(records, plan.nodes, plan.warmup_steps)
            runs.append(
                {
                    "pair": pair,
                    "mode": mode,
                    "step_times_s": times,
                    "steps_run": _steps_run(records),
                    "cpu_s": cpu.by_role(),
                }
            )
            median = f"{statistics.median(times):.4f} s" if times else "-"
            on_run(f"steady state {mode} #{pair + 1}: median step {median} ({len(times)} steps)")
    return {
        "plan": {**dataclasses.asdict(plan), "pairs": pairs},
        "runs": runs,
        **summarize_steady(runs),
    }
