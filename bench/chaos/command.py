"""``python -m bench chaos --schedules N --seed S --nodes K --out DIR``."""

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

from bench.chaos.campaign import ReferenceRunError, run_campaign, summary_table
from bench.chaos.plan import ChaosPlan
from lab.local import netns, process_tree
from lab.local.etcd_server import EtcdError
from training.elastic.exit_codes import BAD_INPUT, OK, PERMANENT, signal_exit

DEFAULT_SCHEDULES = 200


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench chaos",
        description="Random schedules of overlapping faults (evict, kill, freeze, a freeze that "
        "comes back, also during an upload, join, etcd outage, evict-all then new nodes, SIGTERM "
        "during a restore or an upload, a slow or failing store, a node cut off from its "
        "peers, nodes cut off from etcd as a new one may arrive), 0-3 s apart, on real agents "
        "with 1 or 2 processes each; every schedule is checked against the job's invariants. "
        "Exit 1 when any is violated.",
    )
    parser.add_argument(
        "--schedules", type=int, default=DEFAULT_SCHEDULES, help=f"(default {DEFAULT_SCHEDULES})"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        help="schedule i uses seed S+i; --seed S --schedules 1 "
        "replays the one a line names (default 1)",
    )
    parser.add_argument(
        "--nodes", type=int, default=3, help="nodes, and the job's most (default 3)"
    )
    parser.add_argument(
        "--faults", default="3-6", help="faults per schedule, MIN-MAX (default 3-6)"
    )
    parser.add_argument(
        "--max-steps", type=int, default=240, help="steps per schedule (default 240)"
    )
    parser.add_argument(
        "--nproc-per-node",
        default="1,2",
        help="training processes per node, one of these drawn per schedule (default 1,2)",
    )
    parser.add_argument(
        "--no-partitions",
        dest="partitions",
        action="store_false",
        help="draw no partition (a node cut off from its peers, not from etcd) and no "
        "etcd-cut (nodes cut off from etcd, not from their peers): they need network "
        "namespaces, so root",
    )
    parser.add_argument(
        "--out", type=Path, help="output dir (default bench-results/chaos-<timestamp>); must be new"
    )
    return parser


def plan_from_args(args: argparse.Namespace) -> ChaosPlan:
    try:
        low, high = (int(x) for x in args.faults.split("-"))
    except ValueError:
        raise ValueError(f"--faults must be MIN-MAX, e.g. 3-6, got {args.faults!r}") from None
    try:
        nprocs = tuple(int(x) for x in args.nproc_per_node.split(","))
    except ValueError:
        raise ValueError(
            f"--nproc-per-node must be a comma-separated list of 1-2, got {args.nproc_per_node!r}"
        ) from None
    plan = dataclasses.replace(
        ChaosPlan(),
        nodes=args.nodes,
        faults=(low, high),
        max_steps=args.max_steps,
        nproc_per_node=nprocs,
        partitions=args.partitions,
    )
    plan.validate()
    return plan


def check_partitions(plan: ChaosPlan) -> None:
    """ValueError naming --no-partitions when partitions are drawn but cannot be made here."""
    reason = netns.unavailable() if plan.partitions else None
    if reason is not None:
        raise ValueError(
            f"a partition needs network namespaces: {reason}; run as root or pass --no-partitions"
        )


def _out_dir(path: Path | None) -> Path:
    out = path or Path("bench-results") / time.strftime("chaos-%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out: {out} already exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _say(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    check_partitions(plan)
    if args.schedules < 1:
        raise ValueError(f"--schedules must be >= 1, got {args.schedules}")
    out = _out_dir(args.out)
    results = run_campaign(plan, seed=args.seed, schedules=args.schedules, out=out, say=_say)
    results["command"] = ["python", "-m", "bench", "chaos", *sys.argv[2:]]
    (out / "chaos.json").write_text(json.dumps(results, indent=1) + "\n")
    planned = results["schedules_planned"] if results["interrupted"] else None
    table = summary_table(results["summary"], results["plan"], args.seed, planned)
    (out / "chaos.txt").write_text(table + "\n")
    print("\n" + table)
    print(f"\nresults: {out / 'chaos.json'}")
    if results["summary"]["violations"]:
        return PERMANENT
    return signal_exit(signal.SIGINT) if results["interrupted"] else OK


def main(argv: list[str]) -> int:
    """Entry point; the exit code (1 when an invariant was violated)."""
    args = build_parser().parse_args(argv)
    process_tree.become_subreaper()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        return run(args)
    except (ValueError, EtcdError) as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    except ReferenceRunError as err:
        print(f"chaos failed: {err}", file=sys.stderr)
        return PERMANENT
    except KeyboardInterrupt:
        print("\ninterrupted; everything the campaign started is stopped", file=sys.stderr)
        return signal_exit(signal.SIGINT)
    finally:
        for pid in process_tree.descendants(os.getpid()):
            process_tree.kill_tree(pid)
        process_tree.reap_orphans(keep=set())
