"""``python -m bench.reform [--reps N] [--model-width W]``: the re-form after a peer loss on
nodes with two processes each, on Azurite; one line per repetition, then the medians."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.reform.peer_loss import one_loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reform", description=__doc__)
    parser.add_argument("--reps", type=int, default=5, help="peer losses measured (>= 1)")
    parser.add_argument("--model-width", type=int, default=64, help="the model's width (>= 1)")
    flags = parser.parse_args(argv)
    if flags.reps < 1 or flags.model_width < 1:
        parser.error("--reps and --model-width must be >= 1")
    runs = []
    for rep in range(flags.reps):
        run = one_loss(flags.model_width)
        runs.append(run)
        sys.stdout.write(f"rep {rep}: {json.dumps(run)}\n")
        sys.stdout.flush()
    reform = statistics.median(r["reform_s"] for r in runs)
    durable = sum(r["durable_saves"] > 0 for r in runs)
    sys.stdout.write(
        f"median re-form after a peer loss: {reform:.2f} s; "
        f"losses with a durable save on the survivor: {durable} of {len(runs)}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
