"""The step time with periodic sharded saves against none, on one world (FSDP2, gloo, CPU).

Without the trainer, its way of saving is followed (training/loop/saves/sharded.py): at a due
step every rank votes (one all-reduce) whether any is still writing the previous save; if none
is, each snapshots its part in the loop (the stall) and a background thread writes it
(``ShardedCheckpoints.save``, collective on a gloo group of its own, as the trainer's
``checkpoint_group``), one save in flight. The same processes alternate runs without saves and
runs with them; a run's time per step is its wall time over its steps, the last save's write
included (so a save that is never overlapped still counts).
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.sharded_state.model import build, init_world, train_step
from training.checkpoints.serialization import snapshot
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import ModelState, TrainerState, training_state
from training.checkpoints.storage import FileStore

WORLD = 2


def _run(
    model: Any,
    optimizer: torch.optim.Optimizer,
    width: int,
    steps: int,
    every: int,
    saving: tuple[ShardedCheckpoints, Any, TrainerState] | None,
) -> dict[str, float]:
    pool = ThreadPoolExecutor(1, thread_name_prefix="saver")
    in_flight: Future | None = None
    saves, stall_s = 0, 0.0
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, width)
        if saving is None:
            continue
        checkpoints, group, trainer = saving
        trainer.step += 1
        if trainer.step % every:
            continue
        busy = torch.tensor([float(in_flight is not None and not in_flight.done())])
        dist.all_reduce(busy)
        if busy.item() > 0:
            continue  # some rank still writes the previous one
        snapped = time.perf_counter()
        state = training_state(ModelState(model, optimizer), trainer)
        staged = snapshot({k: v.state_dict() for k, v in state.items()})
        stall_s += time.perf_counter() - snapped
        in_flight = pool.submit(checkpoints.save, staged, trainer.step, group=group)
        saves += 1
    if in_flight is not None:
        in_flight.result()
    elapsed = time.perf_counter() - started
    pool.shutdown()
    return {"step_s": elapsed / steps, "saves": saves, "stall_s": stall_s}


def _rank(rank: int, world: int, shape: tuple[int, int], plan: dict[str, int], root: str) -> None:
    base = Path(root)
    init_world(base, "steady", rank, world)
    try:
        group = dist.new_group(backend="gloo")  # the saves' collectives, off the training's
        layers, width = shape
        model, optimizer = build(layers, width, world, seed=0)
        checkpoints = ShardedCheckpoints(FileStore(base / "store"), base / f"scratch-{rank}")
        trainer = TrainerState()
        steps, every = plan["steps"], plan["every"]
        _run(model, optimizer, width, every, every, None)  # warm up: FSDP's lazy init, gloo
        runs: list[dict[str, Any]] = []
        for _ in range(plan["pairs"]):
            runs.append({"saving": False, **_run(model, optimizer, width, steps, every, None)})
            saving = (checkpoints, group, trainer)
            runs.append({"saving": True, **_run(model, optimizer, width, steps, every, saving)})
        (base / f"steady-{rank}.json").write_text(json.dumps(runs))
    finally:
        dist.destroy_process_group()


def measure_steady(
    shape: tuple[int, int], steps: int, every: int, pairs: int, root: Path
) -> dict[str, Any]:
    """Rank 0's runs (the ranks step together), the medians and their ratio."""
    plan = {"steps": steps, "every": every, "pairs": pairs}
    mp.spawn(_rank, args=(WORLD, shape, plan, str(root)), nprocs=WORLD)
    runs = json.loads((root / "steady-0.json").read_text())
    static = statistics.median(r["step_s"] for r in runs if not r["saving"])
    saving = statistics.median(r["step_s"] for r in runs if r["saving"])
    return {
        "world": WORLD,
        **plan,
        "runs": runs,
        "static_step_s": static,
        "saving_step_s": saving,
        "ratio": saving / static,
    }
