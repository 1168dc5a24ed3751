"""The training step over a dataset that is slow to read (a delay per item, as a read from
Blob or a cold disk is), with each way the loop can fetch its items:

- **inline**: every item read when the step asks for it, in the training thread
  (``--loader-workers 0``, the loop until issue 35);
- **workers**: ``--loader-workers`` threads reading this rank's items ``--prefetch-steps``
  steps ahead (training/data/loader.py, ``PrefetchLoader``);
- **stream**: the same items as a stream, read in order by its one reader thread
  (``StreamLoader``).

A step is what the loop runs for one rank at world size 1: the sampler's indices, the items of
each micro-batch from the loader, collate, forward, backward, ``optimizer.step()``, over an
MLP whose compute is of the order of the reads. The modes alternate in rounds, so a load change
on the machine hits them alike; the table gives each mode's median step time and inline over
each of the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.data.loader import InlineLoader, Loader, PrefetchLoader, StreamLoader
from training.data.sampler import ElasticSampler, StreamSampler
from training.elastic.exit_codes import BAD_INPUT

MODES = ("inline", "workers", "stream")
WIDTH = 64


class SlowSamples:
    """Indexable samples: each read waits ``delay_s`` (the I/O), then makes its tensors."""

    digest = "bench"

    def __init__(self, count: int, delay_s: float) -> None:
        self.count, self.delay_s = count, delay_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        x = torch.full((WIDTH,), float(index % 97) / 97.0)
        return x, x[:1] * 2.0


class SlowStream:
    """The same items as a stream: read in order, each with the same delay."""

    identity = "bench@1"

    def __init__(self, samples: SlowSamples) -> None:
        self.samples = samples

    def read(self, start: int) -> Iterator[Any]:
        for index in range(start, len(self.samples)):
            yield self.samples[index]


def _loader(mode: str, args: argparse.Namespace) -> tuple[Loader, Any]:
    count = (args.warmup + args.steps) * args.global_batch
    if mode == "stream":
        stream = SlowStream(SlowSamples(count, args.delay_ms / 1e3))
        return StreamLoader(stream, args.global_batch, 1, 0, args.prefetch_steps), StreamSampler(
            args.global_batch
        )
    samples = SlowSamples(count, args.delay_ms / 1e3)
    sampler = ElasticSampler(count, args.global_batch, seed=0)
    if mode == "inline":
        return InlineLoader(samples), sampler
    return PrefetchLoader(samples, sampler, 1, 0, args.workers, args.prefetch_steps), sampler


def run_mode(mode: str, args: argparse.Namespace) -> list[float]:
    """Step times of ``args.steps`` steps after ``args.warmup`` untimed ones."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.hidden if i else WIDTH, args.hidden) for i in range(3)])
    model.append(nn.Linear(args.hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader, sampler = _loader(mode, args)
    times = []
    try:
        for step in range(args.warmup + args.steps):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            indices = sampler.rank_indices(step, 1, 0)
            for offset in range(0, args.global_batch, args.micro_batch):
                items = loader.items(step, indices[offset : offset + args.micro_batch])
                x = torch.stack([item[0] for item in items])
                y = torch.stack([item[1] for item in items])
                ((model(x) - y) ** 2).sum().backward()
            optimizer.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
    finally:
        loader.close()
    return times


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode] += run_mode(mode, args)
    return times


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> tuple[str, dict]:
    median = {mode: statistics.median(values) for mode, values in times.items()}
    results = {
        "threads": torch.get_num_threads(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "torch": torch.__version__,
        "delay_ms_per_item": args.delay_ms,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "hidden": args.hidden,
        "loader_workers": args.workers,
        "prefetch_steps": args.prefetch_steps,
        "steps_per_mode": len(times["inline"]),
        "median_step_s": {mode: round(value, 6) for mode, value in median.items()},
        "inline_over_workers": round(median["inline"] / median["workers"], 3),
        "inline_over_stream": round(median["inline"] / median["stream"], 3),
    }
    reads = args.delay_ms * args.global_batch
    lines = [
        f"training step, {args.global_batch} items a step in micro-batches of "
        f"{args.micro_batch}, {args.delay_ms:g} ms to read an item ({reads:g} ms of reads a "
        f"step), MLP {WIDTH}->{args.hidden}x3->1, {torch.get_num_threads()} torch threads, "
        f"median of {len(times['inline'])} steps per mode, load average "
        f"{results['load_average'][0]:g}",
        f"{'inline':>10} {f'{args.workers} workers':>12} {'stream':>10} "
        f"{'inline/workers':>15} {'inline/stream':>14}",
        f"{median['inline'] * 1e3:>8.1f}ms {median['workers'] * 1e3:>10.1f}ms "
        f"{median['stream'] * 1e3:>8.1f}ms {results['inline_over_workers']:>14.2f}x "
        f"{results['inline_over_stream']:>13.2f}x",
    ]
    return "\n".join(lines), results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench input-pipeline",
        description="The training step on a dataset slow to read: items fetched in the "
        "training thread, by loader threads ahead of the step, and as a stream, side by side.",
    )
    parser.add_argument("--delay-ms", type=float, default=2.0, help="read time an item (2)")
    parser.add_argument("--workers", type=int, default=4, help="loader threads (4)")
    parser.add_argument("--prefetch-steps", type=int, default=2, help="steps read ahead (2)")
    parser.add_argument("--global-batch", type=int, default=32, help="items a step (32)")
    parser.add_argument("--micro-batch", type=int, default=16, help="items a forward (16)")
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's width (512)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every mode (3)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode a round (8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (2)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (1)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = ("workers", "global_batch", "micro_batch", "hidden", "rounds", "steps", "threads")
    bad = [name for name in counts if getattr(args, name) < 1]
    if bad or args.warmup < 0 or args.prefetch_steps < 0 or args.delay_ms < 0:
        name = (bad or ["warmup, --prefetch-steps or --delay-ms"])[0].replace("_", "-")
        print(f"error: --{name}: counts must be >= 1, the others >= 0", file=sys.stderr)
        return BAD_INPUT
    if args.global_batch % args.micro_batch:
        print("error: --global-batch must be a multiple of --micro-batch", file=sys.stderr)
        return BAD_INPUT
    torch.set_num_threads(args.threads)
    text, results = report(args, measure(args))
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0
