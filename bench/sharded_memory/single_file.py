"""The DDP path's periodic save and its restore (``agree_on_resume``), each rank measuring its
own peak RSS.

The DDP path keeps single-file checkpoints: on a re-form the ranks agree on the newest state
any of them reaches, and its holder (which maps the file: a durable one once fetched to local
disk) sends it to the others. Here rank 0 holds it, either as its
node's emergency save ("local") or as the head of the durable directory store ("durable"); the
other ranks have neither. The state is a DDP replica's shape: per layer a float32 weight and
AdamW's two moments. Peaks are read as in ``peak_rss.py``. The save is rank 0's periodic one
(``commit_from_disk``, training/loop/saves/periodic.py), from the snapshot the loop took: what it
adds over that snapshot.
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
from training.checkpoints.checkpoint import CheckpointRepository
from training.checkpoints.node_local import NodeLocalState
from training.checkpoints.resume import agree_on_resume
from training.checkpoints.storage import FileStore
from training.loop.saves.periodic import commit_from_disk

RUN = "bench"
SOURCES = ("local", "durable")


def _state(state_mib: int) -> dict:
    """``state_mib`` of float32 tensors: ``LAYERS`` weights, each with two moments."""
    numel = state_mib * MIB // (3 * LAYERS * 4)
    generator = torch.Generator().manual_seed(0)
    weights = {f"{i}.weight": torch.randn(numel, generator=generator) for i in range(LAYERS)}
    moments = {
        i: {"step": torch.tensor(1.0), "exp_avg": w * 0.1, "exp_avg_sq": w * w}
        for i, w in enumerate(weights.values())
    }
    return {"step": 1, "model": weights, "optimizer": {"state": moments, "param_groups": []}}


def _share(state: dict) -> int:
    flat = [*state["model"].values()]
    flat += [t for s in state["optimizer"]["state"].values() for t in s.values()]
    return sum(t.numel() * t.element_size() for t in flat)


def _rank(rank: int, world: int, root: str, source: str) -> None:
    base = Path(root)
    store = dist.FileStore(str(base / f"init-{source}"), world)
    store.set_timeout(timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        runtime = _reset_peak()
        local = NodeLocalState(base / f"{source}-local-{rank}", RUN)
        durable = CheckpointRepository(FileStore(base / f"{source}-durable"))
        before = _reset_peak()
        resume = agree_on_resume(
            rank, torch.device("cpu"), local, durable, scratch=base / f"scratch-{rank}"
        )
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
    durable = CheckpointRepository(FileStore(base / "save-durable"))
    before = _reset_peak()
    commit_from_disk(durable, 1, snapshot, base / "save-scratch")
    row = {"rank": 0, "share": _share(snapshot), "runtime": runtime, "before": before}
    (base / "save-0.json").write_text(json.dumps({**row, "peak": _peak()}))


def measure(state_mib: int, world: int, root: Path) -> dict[str, list[dict[str, int]]]:
    """For a restore from rank 0's node-local save and one from the durable store (each in
    processes of its own), each rank's row as ``peak_rss.measure`` gives it."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    state = _state(state_mib)
    NodeLocalState(root / "local-local-0", RUN).save_state(1, state)
    CheckpointRepository(FileStore(root / "durable-durable")).commit(
        1, NodeLocalState(root / "spool", RUN).save_state(1, state)
    )
    del state
    mp.spawn(_save, args=(str(root), state_mib), nprocs=1)
    rows = {"save": [json.loads((root / "save-0.json").read_text())]}
    for source in SOURCES:
        mp.spawn(_rank, args=(world, str(root), source), nprocs=world)
        rows[source] = [json.loads((root / f"{source}-{r}.json").read_text()) for r in range(world)]
    return rows
