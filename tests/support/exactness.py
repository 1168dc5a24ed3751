"""Both tasks' float64 runs, interrupted and resumed, against an uninterrupted one.

A run is a series of segments over one durable store. A segment is either a Trainer in this
process (a gloo group of one) or a world of spawned ranks, each its own "node" with its own
node-local directory, the durable store shared; a segment may end at a step of its choosing:
killed (every rank exits at the step boundary, no save), or a fault raised inside the task.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.support.elastic_cluster import final_parameters, max_abs_difference
from tests.support.trainer_harness import Harness, harness, one_process_world
from tests.support.waiting import gloo_group
from training.checkpoints.storage import FileStore
from training.data.cifar10 import write_synthetic_cifar10
from training.loop.dist import DistEnv, new_checkpoint_group
from training.loop.metrics import Phases
from training.records import events_named, read_lines

REPO = Path(__file__).resolve().parents[2]
CORPUS_SAMPLE = REPO / "training" / "data" / "samples" / "tinyshakespeare" / "input.txt"
TOLERANCE = 1e-9
"""float64 runs at world sizes 1-3 agree to ~1e-15; one step more or less moves ~1e-3."""
GLOBAL_BATCH = [
    "--global-batch-size=12",
    "--micro-batch-size=4",
    "--dtype=float64",
    "--log-every=1",
]
TASK_FLAGS = {
    "cifar": ["--model-width=4", "--model-blocks=1"],
    "charlm": [
        "--task=charlm",
        "--block-size=16",
        "--n-layer=1",
        "--n-head=2",
        "--n-embd=16",
        "--warmup-steps=4",
        "--decay-steps=40",
        "--eval-every=0",
    ],
}
STEPS_PER_EPOCH = 4
"""Both datasets hold 4 global batches of 12 (and a remainder that is never drawn)."""


def make_data(task: str, root: Path) -> Path:
    """A dataset of ``STEPS_PER_EPOCH`` global batches for ``task``."""
    root.mkdir(parents=True, exist_ok=True)
    if task == "cifar":
        write_synthetic_cifar10(root, train_records=50, test_records=8, train_files=1, seed=3)
    else:  # 50 windows of 16 characters in the 90% that trains, from the shipped sample
        text = CORPUS_SAMPLE.read_text()[: int(50 * 16 / 0.9) + 40]
        (root / "input.txt").write_text(text)
    return root


def flags(task: str, *extra: str) -> list[str]:
    return [*GLOBAL_BATCH, *TASK_FLAGS[task], *extra]


def run_here(
    root: Path,
    data: Path,
    args: Sequence[str],
    before: Callable[[Harness, SimpleNamespace], None] | None = None,
    **kwargs: Any,
) -> tuple[Harness, int]:
    """A segment in this process, at world size 1: the harness and its exit code. ``before``
    may arrange a stop or a fault."""
    stop = SimpleNamespace(requested=False, at=None)
    with one_process_world():
        h = harness(root, data, *args, tiny=(), **kwargs)
        if before is not None:
            before(h, stop)
        code = h.trainer.run(stop, Phases())
        h.trainer.saver.wait(60)
    return h, code


def _segment_worker(
    rank: int, world: int, root: str, data: str, args: list[str], kill_at: int, out: dict
) -> None:
    with gloo_group(f"{root}/init-{world}", rank, world, timeout_s=30):
        env = DistEnv(rank=rank, world_size=world, group_rank=rank, run_id="x", max_restarts=9)
        node = Path(root) / f"world{world}-node{rank}"
        durable = FileStore(Path(root) / "durable")
        h = harness(
            node, Path(data), *args, tiny=(), store=durable, env=env, group=new_checkpoint_group(60)
        )
        if kill_at:
            real_step = h.trainer.train_step

            def train_step() -> tuple[float, int]:
                if h.trainer.state.step == kill_at:  # every rank at the same step boundary
                    h.trainer.saver.wait(60)
                    os._exit(0)
                return real_step()

            h.trainer.train_step = train_step  # type: ignore[method-assign]
        code = h.trainer.run(SimpleNamespace(requested=False, at=None), Phases())
        out[rank] = (code, h.stream.getvalue())


def run_spawned(root: Path, data: Path, world: int, args: Sequence[str], kill_at: int = 0) -> dict:
    """A segment of ``world`` spawned ranks; {rank: (exit code, its JSON lines)}."""
    out = mp.Manager().dict()
    mp.spawn(
        _segment_worker,
        args=(world, str(root), str(data), list(args), kill_at, out),
        nprocs=world,
        join=True,
    )
    return dict(out)


def events(lines: str, name: str) -> list[dict[str, Any]]:
    return events_named(read_lines(lines), name)


def reference(root: Path, data: Path, args: Sequence[str]) -> dict[str, torch.Tensor]:
    """The final parameters of an uninterrupted run in this process (cached per root)."""
    if not (root / "durable").exists():
        shutil.rmtree(root, ignore_errors=True)
        run_here(root, data, args)
    return final_parameters(root / "durable")


def matches(durable_root: Path, expected: dict[str, torch.Tensor]) -> float:
    return max_abs_difference(final_parameters(durable_root / "durable"), expected)


def raising_in_micro_batch(
    spec: Any, step: int, micro_batch: int, error: Callable[[], BaseException]
) -> Any:
    """``spec`` whose loss raises ``error()`` in micro-batch ``micro_batch`` (0-based) of
    ``step``, once."""
    from dataclasses import replace

    seen: list[int] = []

    def loss(model: Any, batch: Any, where: Any) -> Any:
        if where.step == step:
            seen.append(1)
            if len(seen) == micro_batch + 1:
                raise error()
        return spec.loss(model, batch, where)

    return replace(spec, loss=loss)
