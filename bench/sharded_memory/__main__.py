"""``python -m bench.sharded_memory [--mode fsdp2|ddp|ddp-file] [--state-mib N] [--worlds 1 2 3]``:
each rank's peak RSS while it saves and while it restores a sharded checkpoint of a model whose
training state (parameters and AdamW's two moments) is N MiB, at each world size; one line per
rank, in MiB. ``ddp-file``: the DDP path: a node's replica saved as one process's DCP
checkpoint, and the restore from rank 0's node-local file and from the durable store
(``single_file.py``)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.sharded_memory import single_file
from bench.sharded_memory.peak_rss import MIB, measure

MODES = ("fsdp2", "ddp", "ddp-file")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sharded_memory", description=__doc__)
    parser.add_argument("--mode", default="fsdp2", help=f"one of {', '.join(MODES)}")
    parser.add_argument("--state-mib", type=int, default=96, help="the whole state (>= 3)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3], help="ranks (>= 1)")
    flags = parser.parse_args(argv)
    if flags.mode not in MODES:
        parser.error(f"--mode must be one of {', '.join(MODES)}, got {flags.mode!r}")
    if flags.state_mib < 3 or min(flags.worlds) < 1:
        parser.error("--state-mib must be >= 3 and each of --worlds >= 1")
    sys.stdout.write(
        f"{flags.mode}, whole state {flags.state_mib} MiB. Per rank, in MiB: its share of the "
        "state; RSS without any state (torch, gloo); RSS before the operation; its peak during "
        "it; the peak over the RSS before\n"
    )
    for world in flags.worlds:
        with tempfile.TemporaryDirectory(prefix="sharded-memory-") as root:
            if flags.mode == "ddp-file":
                measured = single_file.measure(flags.state_mib, world, Path(root))
            else:
                measured = measure(flags.mode, flags.state_mib, world, Path(root))
            for phase, rows in measured.items():
                for row in rows:
                    sys.stdout.write(_line(world, phase, row))
                    sys.stdout.flush()
    return 0


def _line(world: int, phase: str, row: dict[str, int]) -> str:
    share, runtime, before, peak = (row[k] / MIB for k in ("share", "runtime", "before", "peak"))
    return (
        f"world {world} rank {row['rank']} {phase:>7}: share {share:7.1f}  runtime {runtime:6.1f}"
        f"  before {before:7.1f}  peak {peak:7.1f}  peak-before {peak - before:6.1f}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
