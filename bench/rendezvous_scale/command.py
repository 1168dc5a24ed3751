"""``python -m bench rendezvous-scale``: the flags, the output directory and the exit status."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from bench.rendezvous_scale.agents import ScaleError
from bench.rendezvous_scale.runner import ScaleConfig, run_scale
from bench.rendezvous_scale.tables import report_text
from lab.local.etcd_server import EtcdError, find_etcd_binary
from training.elastic.exit_codes import BAD_INPUT, OK, PERMANENT, signal_exit


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    defaults = ScaleConfig()
    parser = argparse.ArgumentParser(
        prog="python -m bench rendezvous-scale",
        description="Run N rendezvous agents (the training's handler, without workers) "
        "against one etcd 3.5: first round, re-form after a death and after a leave, false "
        "deaths, etcd requests/s; then a model calibrated on them for larger N. Exit status: "
        "0 done, 1 a round did not form, 2 bad input, 130 interrupted.",
    )

    def csv(values: tuple[int, ...]) -> str:
        return ",".join(map(str, values))

    parser.add_argument(
        "--nodes", type=_counts, help=f"node counts to run (default {csv(defaults.nodes)})"
    )
    parser.add_argument("--reps", type=int, help=f"repetitions per count (default {defaults.reps})")
    parser.add_argument(
        "--quiet-s",
        type=float,
        help=f"quiet window for false deaths (default {defaults.quiet_s:g})",
    )
    parser.add_argument(
        "--per-process",
        type=int,
        help=f"agents per worker process (default {defaults.per_process})",
    )
    parser.add_argument(
        "--cap-s", type=int, help=f"give a round up after this long (default {defaults.cap_s})"
    )
    parser.add_argument(
        "--model-nodes",
        type=_counts,
        help=f"node counts to model beyond the largest run (default {csv(defaults.model_nodes)})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output dir (default bench-results/rendezvous-scale-<timestamp>); must be new",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    return parser


def config_from_args(args: argparse.Namespace) -> ScaleConfig:
    given = {
        key: getattr(args, key)
        for key in ("nodes", "reps", "quiet_s", "per_process", "cap_s", "model_nodes")
        if getattr(args, key) is not None
    }
    config = ScaleConfig(**given)
    config.validate()
    return config


def _out_dir(path: Path | None) -> Path:
    out = path or Path("bench-results") / f"rendezvous-scale-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out: {out} already exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    """``python -m bench rendezvous-scale [flags]``; returns the exit status."""
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        config = config_from_args(args)
        find_etcd_binary()  # fail before anything starts
        out = _out_dir(args.out)
        results = run_scale(config, out, _say)
    except (ValueError, EtcdError) as err:
        _say(f"error: {err}")
        return BAD_INPUT
    except ScaleError as err:
        _say(f"benchmark failed: {err}")
        return PERMANENT
    except KeyboardInterrupt:
        _say("\ninterrupted; the agents' processes and etcd are stopped")
        return signal_exit(signal.SIGINT)
    results["command"] = ["python", "-m", "bench", "rendezvous-scale", *argv]
    text = report_text(results)
    (out / "rendezvous-scale.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "rendezvous-scale.txt").write_text(text + "\n")
    print(json.dumps(results, indent=2) if args.json else text)
    _say(f"results: {out / 'rendezvous-scale.json'}")
    failed = [m["nodes"] for m in results["measured"] if m["summary"]["errors"]]
    for nodes in failed:
        _say(f"N={nodes}: a round did not form; see {out / 'workers.log'}")
    return PERMANENT if failed else OK
