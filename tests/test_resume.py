"""Rank agreement on resume: real gloo process groups, one process per rank."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.checkpoint import CheckpointRepository, serialize
from training.resume import NodeLocalState, agree_on_resume
from training.storage import FileStore

RUN = "run-1"


def _state(step: int) -> bytes:
    return serialize({"step": step, "w": torch.full((8,), float(step))})


def _worker(rank: int, world: int, init_file: str, root: str, results: dict) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    try:
        base = Path(root)
        local = NodeLocalState(base / f"local-{rank}", RUN)
        durable_dir = base / f"durable-view-{rank}"
        durable = CheckpointRepository(
            FileStore(durable_dir if durable_dir.exists() else base / "durable")
        )
        resume = agree_on_resume(rank, torch.device("cpu"), local, durable)
        w = resume.state["w"].tolist() if resume.state else None
        results[rank] = (resume.step, resume.source, resume.from_rank, resume.lost_steps, w)
    finally:
        dist.destroy_process_group()


def _agree(tmp_path: Path, world: int) -> dict[int, tuple]:
    results = mp.Manager().dict()
    mp.spawn(
        _worker,
        args=(world, str(tmp_path / "init"), str(tmp_path), results),
        nprocs=world,
        join=True,
    )
    return dict(results)


def _local(tmp_path: Path, rank: int) -> NodeLocalState:
    return NodeLocalState(tmp_path / f"local-{rank}", RUN)


@pytest.mark.timeout(120)
def test_fresh_start_when_nothing_is_saved(tmp_path: Path) -> None:
    results = _agree(tmp_path, 2)
    assert {r[:2] for r in results.values()} == {(0, "fresh")}


@pytest.mark.timeout(120)
def test_newest_local_save_wins_and_is_broadcast(tmp_path: Path) -> None:
    CheckpointRepository(FileStore(tmp_path / "durable")).commit(5, _state(5))
    _local(tmp_path, 2).save(9, _state(9))
    _local(tmp_path, 2).mark_progress(9)
    results = _agree(tmp_path, 3)
    assert set(results) == {0, 1, 2}
    for step, source, holder, lost, w in results.values():
        assert (step, source, holder, lost) == (9, "local", 2, 0)
        assert w == [9.0] * 8


@pytest.mark.timeout(120)
def test_durable_wins_over_older_local_and_reports_lost_steps(tmp_path: Path) -> None:
    CheckpointRepository(FileStore(tmp_path / "durable")).commit(12, _state(12))
    _local(tmp_path, 0).save(4, _state(4))
    _local(tmp_path, 1).mark_progress(15)  # this node had finished step 15 before it failed
    results = _agree(tmp_path, 2)
    for step, source, _, lost, w in results.values():
        assert (step, source, lost) == (12, "durable", 3)
        assert w == [12.0] * 8


@pytest.mark.timeout(120)
def test_a_stale_cached_manifest_on_one_node_cannot_desync_the_group(tmp_path: Path) -> None:
    durable = CheckpointRepository(FileStore(tmp_path / "durable"))
    durable.commit(10, _state(10))
    shutil.copytree(tmp_path / "durable", tmp_path / "durable-view-0")  # rank 0's stale view
    durable.commit(20, _state(20))
    results = _agree(tmp_path, 2)
    assert {(r[0], r[1], r[2]) for r in results.values()} == {(20, "durable", 1)}
    assert all(r[4] == [20.0] * 8 for r in results.values())


@pytest.mark.timeout(120)
def test_torn_durable_head_falls_back_everywhere(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "durable")
    repo = CheckpointRepository(store)
    repo.commit(6, _state(6))
    newest = repo.commit(8, _state(8))
    store.put(newest.name, store.get(newest.name)[:100])
    results = _agree(tmp_path, 2)
    assert {(r[0], r[1]) for r in results.values()} == {(6, "durable")}
    assert all(r[4] == [6.0] * 8 for r in results.values())
