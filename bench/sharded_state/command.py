"""``python -m bench sharded-state``: the flags, the cases in order, the bandwidth probe, the
JSON and the table.

The single-stream bandwidth is one ``put`` of a file of the largest part's size, alone, through
the same store call a part's file takes (a directory: the file linked in and fsynced; Azurite:
one upload in blocks, with the store's own block concurrency), in this process, after the ranks
are done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.commit_deadline import azurite
from bench.sharded_state.ddp import measure_ddp
from bench.sharded_state.fsdp2 import measure_fsdp2, open_store
from bench.sharded_state.model import MIB, shape, state_bytes_of
from bench.sharded_state.report import table, targets
from bench.sharded_state.steady import measure_steady
from training.elastic.exit_codes import BAD_INPUT

QUICK = {
    "state_mib": 12,
    "ddp_state_mib": 4,
    "steady_state_mib": 3,
    "steps": 6,
    "every": 3,
    "pairs": 1,
}
"""Tiny sizes: the smoke test checks the shape of the output, not the speed."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench sharded-state",
        description="An FSDP2 run's state path at GB scale: each rank's part saved alone, the "
        "resharded restore, a kill-all restored at another world size, peak RSS per rank; "
        "today's DDP single-file path beside it; the step time with periodic sharded saves.",
    )
    parser.add_argument("--state-mib", type=int, default=4096, help="FSDP2's whole state")
    parser.add_argument("--ddp-state-mib", type=int, default=1024, help="DDP's whole state")
    parser.add_argument("--world", type=int, default=3, help="FSDP2's ranks before (>= 2)")
    parser.add_argument("--restore-world", type=int, default=2, help="and after (>= 1)")
    parser.add_argument("--steady-state-mib", type=int, default=96, help="the step-time model")
    parser.add_argument("--steps", type=int, default=200, help="steps per step-time run")
    parser.add_argument("--every", type=int, default=50, help="a periodic save every N steps")
    parser.add_argument("--pairs", type=int, default=2, help="static/saving run pairs")
    parser.add_argument("--azurite", action="store_true", help="Azurite as well as a directory")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the smoke test)")
    parser.add_argument("--out", type=Path, help="output dir (default bench-results/<time>)")
    return parser


def _validate(flags: argparse.Namespace) -> None:
    for name in ("state_mib", "ddp_state_mib", "steady_state_mib", "steps", "every", "pairs"):
        if getattr(flags, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(flags, name)}")
    if flags.world < 2 or flags.restore_world < 1 or flags.restore_world == flags.world:
        raise ValueError(
            f"--world must be >= 2 and --restore-world >= 1 and another size, got "
            f"{flags.world} and {flags.restore_world}"
        )
    if flags.out is not None and flags.out.exists() and any(flags.out.iterdir()):
        raise ValueError(f"--out: {flags.out} already exists and is not empty")


@contextmanager
def _stores(kinds: tuple[str, ...], work: Path) -> Iterator[list[dict[str, str]]]:
    """Each store's description, Azurite serving for as long as the block runs."""
    with ExitStack() as stack:
        specs = [{"kind": "directory", "root": str(work / "directory-store")}]
        if "azurite" in kinds:
            url = stack.enter_context(azurite(work / "azurite"))
            specs.append({"kind": "azurite", "uri": f"{url}/bench/sharded"})
        yield specs


def _bandwidth(spec: dict[str, str], size: int, work: Path) -> dict[str, float]:
    """One put of a file of ``size`` bytes (untimed: writing the file)."""
    path = work / f"probe-{spec['kind']}.bin"
    chunk = torch.randn(16 * MIB // 4).numpy().tobytes()
    with open(path, "wb") as f:
        for offset in range(0, size, len(chunk)):
            f.write(chunk[: size - offset])
    store = open_store(spec)
    started = time.perf_counter()
    store.put("bandwidth-probe", path)
    seconds = time.perf_counter() - started
    store.delete("bandwidth-probe")
    path.unlink()
    return {"bytes": size, "seconds": seconds, "bytes_per_s": size / seconds}


def run(flags: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    if flags.quick:
        for name, value in QUICK.items():
            setattr(flags, name, value)
    _validate(flags)
    # Large tensors mapped and unmapped at once: RSS is the memory in use, not glibc's cache.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    layers, width = shape(flags.state_mib * MIB)
    kinds = ("directory", "azurite") if flags.azurite else ("directory",)
    results: dict[str, Any] = {
        "plan": {
            **{k: v for k, v in vars(flags).items() if k != "out"},
            "layers": layers,
            "width": width,
        },
        "fsdp2_state_bytes": state_bytes_of(layers, width),
        "bandwidth": {},
    }
    worlds = (flags.world, flags.restore_world)
    with (
        tempfile.TemporaryDirectory(prefix="bench-sharded-") as tmp,
        _stores(kinds, Path(tmp)) as specs,
    ):
        results["fsdp2"] = measure_fsdp2((layers, width), worlds, specs, Path(tmp), say)
        for spec in specs:
            largest = max(r["part_bytes"] for r in results["fsdp2"][spec["kind"]]["save"])
            results["bandwidth"][spec["kind"]] = _bandwidth(spec, largest, Path(tmp))
    results["ddp"] = measure_ddp(flags.ddp_state_mib, kinds, say)
    say(f"step time: {flags.pairs} pair(s) of {flags.steps} steps ...")
    with tempfile.TemporaryDirectory(prefix="bench-steady-") as tmp:
        steady_shape = shape(flags.steady_state_mib * MIB)
        results["steady"] = measure_steady(
            steady_shape, flags.steps, flags.every, flags.pairs, Path(tmp)
        )
    results["targets"] = targets(results)
    return results


def main(argv: list[str]) -> int:
    flags = build_parser().parse_args(argv)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        results = run(flags, say)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    results["command"] = ["python", "-m", "bench", "sharded-state", *argv]
    results["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results["load_average"] = os.getloadavg()
    out = flags.out or Path("bench-results") / time.strftime("sharded-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "bench.txt").write_text(text + "\n")
    print(text)
    print(f"\nresults: {out / 'bench.json'}")
    return 0
