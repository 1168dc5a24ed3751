"""The DDP path's saves and its restore (``agree_on_resume``), each rank measuring its own peak
RSS.

A DDP node keeps its replica in one file on its disk (an emergency save), and the durable
store keeps ``torch.distributed.checkpoint`` checkpoints. On a re-form the ranks agree on the
newest state any of them reaches, and its holder sends it to the others tensor by tensor: from
the node's file, mapped ("local"), or from the durable checkpoint, loaded into its live state
item by item ("durable"). Here rank 0 holds it; the other ranks have neither, and hold no
state before (a fresh worker's). The state is a DDP replica's shape: per layer a float32
weight and AdamW's two moments. Peaks are read as in ``peak_rss.py``. The save is a DCP
checkpoint of one process's replica (``ShardedCheckpoints.save_alone``: an eviction's durable
commit), from the snapshot the loop took: what it adds over that snapshot.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.sharded_memory.peak_rss import LAYERS, MIB, _peak, _reset_peak
from training.checkpoints.node_local import NodeLocalState
from training.checkpoints.resume import DurableSource, agree_on_resume
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.storage import FileStore

RUN = "bench"
SOURCES = ("local", "durable")


def _state(state_mib: int, random: bool = True) -> dict:
    """``state_mib`` of float32 tensors: ``LAYERS`` weights, each with two moments (zeros
    unless ``random``: a state to load into)."""
    numel = state_mib * MIB // (3 * LAYERS * 4)
    generator = torch.Generator().manual_seed(0)
    draw = (
        (lambda: torch.randn(numel, generator=generator))
        if random
        else (lambda: torch.zeros(numel))
    )
    weights = {f"{i}.weight": draw() for i in range(LAYERS)}
    moments = {
        i: {"step": torch.tensor(1.0), "exp_avg": w * 0.1, "exp_avg_sq": w * w}
        for i, w in enumerate(weights.values())
    }
    return {"step": 1, "model": weights, "optimizer": {"state": moments, "param_groups": []}}


def _share(state: dict) -> int:
    flat = [*state["model"].values()]
    flat += [t for s in state["optimizer"]["state"].values() for t in s.values()]
    return sum(t.numel() * t.element_size() for t in flat)


def _rank(rank: int, world: int, root: str, source: str, state_mib: int) -> None:
    base = Path(root)
    store = dist.FileStore(str(base / f"init-{source}"), world)
    store.set_timeout(timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        runtime = _reset_peak()
        local = NodeLocalState(base / f"{source}-local-{rank}", RUN)
        checkpoints = ShardedCheckpoints(FileStore(base / f"{source}-durable"), base / "scratch")
        durable = DurableSource(checkpoints, lambda: _state(state_mib, random=False))
        before = _reset_peak()
        resume = agree_on_resume(rank, torch.device("cpu"), local, durable)
        assert resume.state is not None and resume.step == 1 and resume.source == source
        row = {
            "rank": rank,
            "share": _share(resume.state),
            "runtime": runtime,
            "before": before,
            "peak": _peak(),
        }
        (base / f"{source}-{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()


def _save(_: int, root: str, state_mib: int) -> None:
    base = Path(root)
    runtime = _reset_peak()
    snapshot = _state(state_mib)  # the loop's CPU copy, which the background thread writes
    durable = ShardedCheckpoints(FileStore(base / "save-durable"), base / "save-scratch")
    before = _reset_peak()
    durable.save_alone(snapshot, 1)
    row = {"rank": 0, "share": _share(snapshot), "runtime": runtime, "before": before}
    (base / "save-0.json").write_text(json.dumps({**row, "peak": _peak()}))


def measure(state_mib: int, world: int, root: Path) -> dict[str, list[dict[str, int]]]:
    """For a restore from rank 0's node-local save and one from the durable store (each in
    processes of its own), each rank's row as ``peak_rss.measure`` gives it."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    state = _state(state_mib)
    NodeLocalState(root / "local-local-0", RUN).save_state(1, state)
    ShardedCheckpoints(FileStore(root / "durable-durable"), root / "scratch").save_alone(state, 1)
    del state
    mp.spawn(_save, args=(str(root), state_mib), nprocs=1)
    rows = {"save": [json.loads((root / "save-0.json").read_text())]}
    for source in SOURCES:
        mp.spawn(_rank, args=(world, str(root), source, state_mib), nprocs=world)
        rows[source] = [json.loads((root / f"{source}-{r}.json").read_text()) for r in range(world)]
    return rows
