"""``python -m bench``: the lab against plain torchrun, side by side, on this machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from bench.scenarios import FAULT_KINDS
from bench.steady_state import BenchRunError
from bench.suite import BenchConfig, default_config, report_text, run_bench, smoke_config
from lab.local import process_tree
from lab.local.etcd_server import EtcdError, find_etcd_binary
from lab.local.session import LabError
from training.elastic.exit_codes import BAD_INPUT, OK, PERMANENT, signal_exit


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure the lab against plain torchrun defaults plus a periodic "
        "checkpoint: recovery per fault kind, steady-state step time, checkpoint stall, an "
        "eviction's commit; then the chaos campaign of overlapping faults.",
        epilog="The rendezvous at scale, an eviction's commit with a large state and the chaos "
        "campaign are also commands of their own: python -m bench rendezvous-scale --help, "
        "python -m bench chaos --help, python -m bench commit-deadline "
        "--help; what charlm's keyed dropout costs a step: python -m bench keyed-random; "
        "loader threads against fetching in the step: python -m bench input-pipeline; an FSDP2 "
        "run's sharded state path at GB scale: python -m bench sharded-state",
    )
    parser.add_argument("--reps", type=int, help="repetitions per fault kind (default 3)")
    parser.add_argument(
        "--kinds", help=f"comma-separated fault kinds (default all: {','.join(FAULT_KINDS)})"
    )
    parser.add_argument(
        "--recovery-cap-s",
        type=float,
        help="report a fault as no recovery after this long (default 60)",
    )
    parser.add_argument(
        "--steady-pairs", type=int, help="elastic/static run pairs for the step time (default 4)"
    )
    parser.add_argument(
        "--chaos-schedules",
        type=int,
        help="schedules of the chaos campaign, 0 to leave it out (default 200; "
        "python -m bench chaos runs it alone)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="one rep of one fault kind, tiny runs (for CI)"
    )
    parser.add_argument(
        "--out", type=Path, help="output dir (default bench-results/<timestamp>); must be new"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The preset (``--smoke`` or the default) with the flags given applied; validated."""
    config = smoke_config() if args.smoke else default_config()
    if args.reps is not None:
        config = dataclasses.replace(config, reps=args.reps)
    if args.kinds is not None:
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        config = dataclasses.replace(config, kinds=kinds)
    if args.recovery_cap_s is not None:
        recovery = dataclasses.replace(config.recovery, recovery_cap_s=args.recovery_cap_s)
        config = dataclasses.replace(config, recovery=recovery)
    if args.steady_pairs is not None:
        config = dataclasses.replace(config, steady_pairs=args.steady_pairs)
    if args.chaos_schedules is not None:
        config = dataclasses.replace(config, chaos_schedules=args.chaos_schedules)
    config.validate()
    return config


def _out_dir(path: Path | None) -> Path:
    out = path or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LabError(f"--out: {out} already exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    find_etcd_binary()  # fail before any run when there is no etcd
    out = _out_dir(args.out)
    results = run_bench(config, out, say=_say)
    results["command"] = ["python", "-m", "bench", *sys.argv[1:]]
    text = report_text(results)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "bench.txt").write_text(text + "\n")
    print(text)
    print(f"\nresults: {out / 'bench.json'}")
    errors = [r for r in results["recovery"]["runs"] if r["error"]]
    for run in errors:
        _say(f"error in {run['session_dir']}: {run['error']}")
    violations = results.get("chaos", {}).get("summary", {}).get("violations", 0)
    if violations:
        _say(f"chaos: {violations} invariant violation(s); see {out / 'chaos' / 'chaos.json'}")
    return PERMANENT if errors or violations else OK


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (1 when a session failed or the chaos campaign found a
    violation, not when a target missed)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rendezvous-scale"]:
        # A command of its own; every other argv is the bench as before. Imported here: it
        # needs none of the bench's machinery.
        from bench.rendezvous_scale.command import main as rendezvous_scale_main

        return rendezvous_scale_main(argv[1:])
    if argv[:1] == ["commit-deadline"]:
        from bench.commit_deadline import main as commit_deadline_main

        return commit_deadline_main(argv[1:])
    if argv[:1] == ["keyed-random"]:
        from bench.keyed_random.command import main as keyed_random_main

        return keyed_random_main(argv[1:])
    if argv[:1] == ["input-pipeline"]:
        from bench.input_pipeline.command import main as input_pipeline_main

        return input_pipeline_main(argv[1:])
    if argv[:1] == ["sharded-state"]:
        from bench.sharded_state.command import main as sharded_state_main

        return sharded_state_main(argv[1:])
    if argv[:1] == ["chaos"]:
        from bench.chaos.command import main as chaos_main

        return chaos_main(argv[1:])
    args = build_parser().parse_args(argv)
    # Orphans of a killed agent re-parent to us, so the final sweep below finds them.
    process_tree.become_subreaper()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        return _run(args)
    except (ValueError, LabError, EtcdError) as err:
        _say(f"error: {err}")
        return BAD_INPUT
    except BenchRunError as err:
        _say(f"benchmark failed: {err}")
        return PERMANENT
    except KeyboardInterrupt:
        _say("\ninterrupted; everything the benchmark started is stopped")
        return signal_exit(signal.SIGINT)
    finally:
        for pid in process_tree.descendants(os.getpid()):
            process_tree.kill_tree(pid)
        process_tree.reap_orphans(keep=set())
