"""The command lines of ``lab watch``, ``lab drill`` and ``lab rebalance``: their flags, checked,
and the run each starts. Light at import (``python -m lab`` builds these parsers for every
command); the Kubernetes and Azure clients load when a command runs.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lab.exit_status import HelpFormatter, bad_flag
from lab.report.gpu_cost import Prices

if TYPE_CHECKING:
    from lab.azure.cluster.follow import CloudOptions

CLUSTER_COMMANDS = ("watch", "drill", "rebalance")


def add_cluster_parsers(sub: argparse._SubParsersAction) -> None:
    """The parsers of ``watch``, ``drill`` and ``rebalance`` under ``python -m lab``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--stack-outputs",
        type=Path,
        required=True,
        metavar="FILE",
        help="the stack's outputs: `pulumi stack output --json --show-secrets > FILE` "
        "(the kubeconfig, namespace and job; for drill also the node resource group and pool)",
    )
    common.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="the run directory: pod logs, events, report (default: lab-runs/cloud-<timestamp>)",
    )
    common.add_argument(
        "--stack",
        help="the stack whose GPU size and region price the run from the cache of `lab prices` "
        "(default: the selected Pulumi stack; without one the cost has no prices)",
    )
    sub.add_parser(
        "watch",
        parents=[common],
        help="follow the PyTorchJob on the cluster; Ctrl-C writes the report",
        description="Follow the job: pods and their nodes, world size, step, loss, samples/s "
        "and the last event of the training logs and of Kubernetes; each of the cluster "
        "autoscaler's capacity events (no Spot capacity, falling back to on-demand, back on "
        "Spot) as a line of its own. Ctrl-C (or the job's end) "
        "stops watching and writes report.json, report.txt and timeline.png for the time "
        "watched. It only reads: it never touches the job.\nExit status: 0 report written, "
        "1 the cluster cannot be reached or refuses, or nothing was logged to report; 2 a bad "
        "--stack-outputs file.",
        formatter_class=HelpFormatter,
    )
    drill = sub.add_parser(
        "drill",
        parents=[common],
        help="evict Spot nodes one at a time and report the recovery (the cloud `make lab`)",
        description="Wait until the job trains at full size, evict one Spot node with "
        "simulate-eviction, wait until training runs again and the replacement has joined; "
        "N times. Then write the same report as the local lab, with each replacement's path "
        "step by step (pod deleted, new pod Pending, node requested, node Ready, image pulled, "
        "container started, joined, first step at full size), the time at each world size "
        "and the run's cost. Refuses a job that is not training at full size.\nExit status: "
        "0 every eviction recovered, 1 the cluster "
        "cannot be reached or refuses, the job is not healthy, an eviction failed or did not "
        "recover in time, or Ctrl-C; 2 a bad flag or --stack-outputs file.",
        formatter_class=HelpFormatter,
    )
    drill.add_argument(
        "--evict",
        type=int,
        default=1,
        metavar="N",
        help="how many Spot nodes to evict, one at a time (default: %(default)s)",
    )
    drill.add_argument(
        "--interval",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds of training at full size between evictions (default: %(default)g)",
    )
    drill.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for the job to train at full size before the first eviction "
        "(default: %(default)g)",
    )
    drill.add_argument(
        "--recover-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds to wait for training to run again after each eviction, then as long for "
        "the replacement to join (default: %(default)g)",
    )
    drill.add_argument(
        "--subscription",
        help="subscription of the cluster's node resource group, for simulate-eviction "
        "(default: $AZURE_SUBSCRIPTION_ID)",
    )
    _rebalance_parser(sub, common)


def _rebalance_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    rebalance = sub.add_parser(
        "rebalance",
        parents=[common],
        help="move the job's workers from on-demand nodes back to Spot nodes, one at a time",
        description="With the on-demand fallback on (onDemandMaxNodes): when a Ready Spot node "
        "of the job's pool is free and workers run on on-demand nodes, drain one on-demand "
        "worker (cordon its node, evict its pod: it saves its last step, the group re-forms "
        "without losing a step), wait until its replacement runs on a Spot node and the group "
        "trains at full size again, then the next. Stops when no worker is left on on-demand, "
        "or when no Spot node comes within --spot-timeout; with no Spot node Ready it changes "
        "nothing and says why. --watch keeps doing it until the job ends. The report records "
        "each move and what it saved.\nExit status: 0 done (or nothing to move), 1 the cluster "
        "cannot be reached or refuses, the job is not healthy, a move did not recover in time, "
        "or Ctrl-C; 2 a bad flag or --stack-outputs file.",
        formatter_class=HelpFormatter,
    )
    rebalance.add_argument(
        "--spot-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds for a drained worker's replacement to land on a Spot node, and after a "
        "move for the next free Spot node to come (default: %(default)g)",
    )
    rebalance.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for the job to train at full size before the first move "
        "(default: %(default)g)",
    )
    rebalance.add_argument(
        "--recover-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds for the group to train at full size again after a move "
        "(default: %(default)g)",
    )
    rebalance.add_argument(
        "--watch",
        action="store_true",
        help="keep moving workers back to Spot whenever a Spot node is free, until the job ends",
    )
    rebalance.add_argument(
        "--poll",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds between looks for a free Spot node while waiting (default: %(default)g)",
    )


# The flags each command checks before it loads a client: (flag, what it allows, the check).
_CHECKS: dict[str, tuple[tuple[str, str, Callable[[float], bool]], ...]] = {
    "watch": (),
    "drill": (
        ("--evict", "a count >= 1", lambda v: v >= 1),
        ("--interval", "seconds >= 0", lambda v: 0 <= v < math.inf),
        ("--ready-timeout", "seconds > 0", lambda v: 0 < v < math.inf),
        ("--recover-timeout", "seconds > 0", lambda v: 0 < v < math.inf),
    ),
    "rebalance": tuple(
        (flag, "seconds > 0", lambda v: 0 < v < math.inf)
        for flag in ("--spot-timeout", "--ready-timeout", "--recover-timeout", "--poll")
    ),
}


def run_cluster_command(args: argparse.Namespace, prices: Prices) -> int:
    """Run ``watch``, ``drill`` or ``rebalance``; ``prices`` price the run's report."""
    for flag, allowed, ok in _CHECKS[args.command]:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if not ok(value):  # nan too: every comparison with it is false
            return bad_flag(flag, allowed, value)
    from lab.azure.cluster.cloud_run import DrillOptions, drill, watch
    from lab.azure.cluster.follow import CloudOptions

    out = args.out or Path("lab-runs") / time.strftime("cloud-%Y%m%d-%H%M%S")
    options = CloudOptions(args.stack_outputs, out, prices)
    if args.command == "watch":
        return watch(options)
    if args.command == "rebalance":
        return _rebalance(args, options)
    plan = DrillOptions(args.evict, args.interval, args.ready_timeout, args.recover_timeout)
    return drill(options, plan, evictor(args))


def _rebalance(args: argparse.Namespace, options: CloudOptions) -> int:
    """``lab rebalance``, its flags checked."""
    from lab.azure.cluster.rebalance import RebalanceOptions, rebalance

    timeouts = (args.spot_timeout, args.ready_timeout, args.recover_timeout)
    plan = RebalanceOptions(*timeouts, watch=args.watch, poll_s=args.poll)
    return rebalance(options, plan)


def evictor(args: argparse.Namespace) -> Callable[[str], int]:
    """Evict through simulate-eviction, as a user would run it."""
    from lab.azure.simulate_eviction import main as simulate_eviction

    def evict(node: str) -> int:
        argv = ["--stack-outputs", str(args.stack_outputs), "--node", node]
        if args.subscription:
            argv += ["--subscription", args.subscription]
        return simulate_eviction(argv)

    return evict
