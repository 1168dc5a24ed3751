"""charlm's training step with dropout on and off: what the keyed masks cost a step.

- **none**: dropout off, the floor;
- **keyed**: ``training.api.keyed_dropout``, one hash over the whole batch per site.

The per-sample generator draw it replaced (a ``torch.Generator`` per sample per site) was
measured beside it once; that figure is recorded in docs/benchmarks.md, and the bench no longer
carries the old draw. A step is what the loop runs for one rank at world size 1: charlm's
``collate`` and ``loss`` per micro-batch, ``backward``, the clip, ``optimizer.step()`` and
``scheduler.step()``, over the shipped Tiny Shakespeare excerpt, with charlm's default shape (4
layers, width 128, 64 characters, global batch 32 in micro-batches of 16) unless flags say
otherwise. The modes alternate in rounds, so a load change on the machine hits them alike; the
table gives each mode's median step time over every round, and one site's mask alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from training.api import BuildContext, MicroBatch
from training.elastic.exit_codes import BAD_INPUT
from training.tasks import charlm

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "training" / "data" / "samples" / "tinyshakespeare"
MODES = ("none", "keyed")


def _step_runner(args: argparse.Namespace, dropout: float) -> Callable[[int], None]:
    options = charlm.CharLMOptions(
        block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd, dropout=dropout
    )
    data = charlm.load_data(str(CORPUS), options)
    torch.manual_seed(0)
    parts = charlm.build(options, data, BuildContext(1e-3, args.global_batch))
    device = torch.device(args.device)
    model = parts.model.to(device)
    micro = args.micro_batch

    def step(index: int) -> None:
        parts.optimizer.zero_grad(set_to_none=True)
        first = index * args.global_batch % (len(data.train) - args.global_batch)
        counted = 0
        for offset in range(0, args.global_batch, micro):
            indices = torch.arange(first + offset, first + offset + micro)
            where = MicroBatch(indices, index, 0, 0, device)
            items = charlm.collate([data.train[int(i)] for i in indices], where)
            batch = {name: tensor.to(device) for name, tensor in items.items()}
            total, count = charlm.loss(model, batch, where)  # (sum, count), as the loop takes it
            total.backward()
            counted += int(count)
        for parameter in model.parameters():  # the loop's mean over the step's count
            if parameter.grad is not None:
                parameter.grad.mul_(1.0 / max(counted, 1))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        parts.optimizer.step()
        if parts.scheduler is not None:
            parts.scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def _time(step: Callable[[int], None], first: int, count: int) -> list[float]:
    times = []
    for i in range(first, first + count):
        started = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - started)
    return times


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each mode's step times, the modes alternating round by round."""
    runners = {"none": _step_runner(args, 0.0), "keyed": _step_runner(args, args.dropout)}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up: allocator, first-call costs
        _time(runners[mode], 0, args.warmup)
    for round_ in range(args.rounds):
        for mode in MODES:
            first = args.warmup + round_ * args.steps
            times[mode] += _time(runners[mode], first, args.steps)
    return times


def measure_one_site(args: argparse.Namespace) -> list[float]:
    """One dropout site alone, forward only, on a micro-batch of charlm's activations."""
    x = torch.randn(
        args.micro_batch, args.block_size, args.n_embd, device=torch.device(args.device)
    )
    where = MicroBatch(torch.arange(args.micro_batch), 0, 0, 0, x.device)
    seeds = where.sample_seeds(charlm.DROPOUT_STREAM)
    times: list[float] = []
    for _ in range(args.rounds * args.steps * 5):
        started = time.perf_counter()
        charlm.keyed_dropout(x, args.dropout, seeds, 1)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        times.append(time.perf_counter() - started)
    return times


def report(
    args: argparse.Namespace, times: dict[str, list[float]], site: list[float]
) -> tuple[str, dict]:
    median = {mode: statistics.median(values) for mode, values in times.items()}
    one = statistics.median(site)
    cost = median["keyed"] - median["none"]
    results = {
        "device": args.device,
        "threads": torch.get_num_threads(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "torch": torch.__version__,
        "shape": {
            "n_layer": args.n_layer,
            "n_embd": args.n_embd,
            "block_size": args.block_size,
            "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
            "dropout": args.dropout,
        },
        "steps_per_mode": len(times["keyed"]),
        "median_step_s": {mode: round(value, 6) for mode, value in median.items()},
        "dropout_cost_s": round(cost, 6),
        "one_site_median_s": round(one, 7),
    }
    lines = [
        f"charlm step time, dropout {args.dropout}, {args.n_layer} layers x {args.n_embd}, "
        f"{args.block_size} chars, batch {args.global_batch} in {args.micro_batch}s, "
        f"{args.device} ({torch.get_num_threads()} threads), median of {len(times['keyed'])} "
        f"steps per mode, load average {results['load_average'][0]:g}",
        f"{'no dropout':>12} {'keyed masks':>12} {'keyed/none':>11}",
        f"{median['none'] * 1e3:>10.2f}ms {median['keyed'] * 1e3:>10.2f}ms "
        f"{median['keyed'] / median['none']:>10.3f}x",
        f"dropout's own cost: {cost * 1e3:.2f} ms a step",
        f"one site's mask alone, forward ({args.micro_batch} x {args.block_size} x "
        f"{args.n_embd}): {one * 1e3:.3f} ms",
    ]
    return "\n".join(lines), results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench keyed-random",
        description="charlm's step time with dropout off and with its keyed masks, side by "
        "side: what the masks cost a step.",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every mode (default 5)")
    parser.add_argument("--steps", type=int, default=4, help="steps per mode per round (4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (2)")
    parser.add_argument("--n-layer", type=int, default=4, help="charlm's --n-layer (4)")
    parser.add_argument("--n-embd", type=int, default=128, help="charlm's --n-embd (128)")
    parser.add_argument("--block-size", type=int, default=64, help="charlm's --block-size (64)")
    parser.add_argument("--global-batch", type=int, default=32, help="samples a step (32)")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples a forward (16)")
    parser.add_argument("--dropout", type=float, default=0.1, help="charlm's --dropout (0.1)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's CPU threads (default 1: on a machine shared with other work, a "
        "parallel op waits for its slowest thread, which drowns the difference measured)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    positive = ("rounds", "steps", "n_layer", "n_embd", "block_size", "global_batch", "threads")
    bad = [name for name in positive if getattr(args, name) < 1]
    if bad or args.warmup < 0 or args.micro_batch < 1 or args.global_batch % args.micro_batch:
        print(
            f"error: --{(bad or ['micro-batch'])[0].replace('_', '-')}: every count must be >= 1 "
            "and --global-batch a multiple of --micro-batch",
            file=sys.stderr,
        )
        return BAD_INPUT
    if not 0.0 < args.dropout < 1.0:
        print(f"error: --dropout must be in (0, 1), got {args.dropout}", file=sys.stderr)
        return BAD_INPUT
    if args.device not in ("cpu", "cuda") or (
        args.device == "cuda" and not torch.cuda.is_available()
    ):
        print(
            f"error: --device must be cpu or cuda (with a GPU), got {args.device!r}",
            file=sys.stderr,
        )
        return BAD_INPUT
    torch.set_num_threads(args.threads)
    text, results = report(args, measure(args), measure_one_site(args))
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0
