"""Rank agreement on resume: real gloo process groups, one process per rank."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.waiting import gloo_group
from training.checkpoints.checkpoint import CheckpointError, Entry, sha256
from training.checkpoints.manifest import StoredFile, metadata_name, shard_name, sharded_id
from training.checkpoints.node_local import NodeLocalState, node_local_key
from training.checkpoints.resume import DurableSource, agree_on_resume
from training.checkpoints.sharded.repository import PREFIX, ShardedCheckpoints
from training.checkpoints.sharded.state import pack
from training.checkpoints.storage import FileStore, ObjectStore
from training.loop.dist import new_checkpoint_group

RUN = "run-1"


def _state(step: int, run: dict[str, Any] | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"step": step, "w": torch.full((8,), float(step))}
    if run is not None:
        state["run"] = pack(run)
    return state


def _checkpoints(store: ObjectStore, scratch: Path) -> ShardedCheckpoints:
    return ShardedCheckpoints(store, scratch)


def _commit(root: Path, step: int) -> Entry:
    """A durable checkpoint of ``step`` (DCP, one process's), in ``root``'s store."""
    return _checkpoints(FileStore(root / "durable"), root / "scratch").save_alone(
        _state(step), step
    )


def _source(store: ObjectStore, scratch: Path) -> DurableSource:
    """The durable checkpoints as a holder reads them: into a live state of zeros."""
    return DurableSource(_checkpoints(store, scratch), lambda: _state(0))


def _is_data(name: str) -> bool:
    return name.endswith((".metadata", ".distcp"))


class _RankStore(FileStore):
    """One rank's view of the durable directory, with the faults a test gives that rank."""

    def __init__(self, root: Path, opts: dict[str, Any], rank: int, log: Path) -> None:
        super().__init__(root)
        self.unreachable = rank in opts.get("unreachable", ())
        self.objects_unreadable = rank in opts.get("objects_unreadable", ())
        self.delay_s = opts.get("slow_get_s", {}).get(rank, 0.0)
        self.log = log

    def _reading(self, name: str) -> None:
        if self.unreachable or (self.objects_unreadable and _is_data(name)):
            raise ConnectionError(f"get {name!r} in {self.describe()}: cannot reach the store")
        if _is_data(name):
            with open(self.log, "a") as log:
                log.write(name + "\n")
            time.sleep(self.delay_s)

    def get(self, name: str) -> bytes:
        self._reading(name)
        return super().get(name)

    def get_into(self, name: str, sink: BinaryIO) -> int:
        self._reading(name)
        return super().get_into(name, sink)

    def link_into(self, name: str, path: Path) -> bool:
        self._reading(name)
        return super().link_into(name, path)


def _worker(
    rank: int, world: int, init_file: str, root: str, results: dict, opts: dict[str, Any]
) -> None:
    # The store has its own long timeout, so a short collective timeout bounds collectives only.
    with gloo_group(init_file, rank, world, opts.get("collective_timeout_s", 30)):
        group = new_checkpoint_group(60) if opts.get("checkpoint_group") else None
        base = Path(root)
        local = NodeLocalState(base / f"local-{rank}", RUN)
        durable_dir = base / f"durable-view-{rank}"
        view = durable_dir if durable_dir.exists() else base / "durable"
        store = _RankStore(view, opts, rank, base / f"gets-{rank}.log")
        durable = _source(store, base / f"scratch-{rank}")
        try:
            resume = agree_on_resume(rank, torch.device("cpu"), local, durable, group=group)
        except CheckpointError as exc:
            results[rank] = ("error", str(exc))
            return
        w = resume.state["w"].tolist() if resume.state else None
        results[rank] = (resume.step, resume.source, resume.from_rank, resume.lost_steps, w)


def _agree(tmp_path: Path, world: int, **opts: Any) -> dict[int, tuple]:
    results = mp.Manager().dict()
    mp.spawn(
        _worker,
        args=(world, str(tmp_path / "init"), str(tmp_path), results, opts),
        nprocs=world,
        join=True,
    )
    return dict(results)


def _object_reads(tmp_path: Path, name: str) -> int:
    logs = tmp_path.glob("gets-*.log")
    return sum(log.read_text().splitlines().count(name) for log in logs)


def _local(tmp_path: Path, rank: int) -> NodeLocalState:
    return NodeLocalState(tmp_path / f"local-{rank}", RUN)


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_fresh_start_when_nothing_is_saved(tmp_path: Path) -> None:
    results = _agree(tmp_path, 2)
    assert {r[:2] for r in results.values()} == {(0, "fresh")}


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_newest_local_save_wins_and_is_broadcast(tmp_path: Path) -> None:
    _commit(tmp_path, 5)
    _local(tmp_path, 2).save_state(9, _state(9))
    _local(tmp_path, 2).mark_progress(9)
    results = _agree(tmp_path, 3)
    assert set(results) == {0, 1, 2}
    for step, source, holder, lost, w in results.values():
        assert (step, source, holder, lost) == (9, "local", 2, 0)
        assert w == [9.0] * 8


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_durable_wins_over_older_local_and_reports_lost_steps(tmp_path: Path) -> None:
    _commit(tmp_path, 12)
    _local(tmp_path, 0).save_state(4, _state(4))
    _local(tmp_path, 1).mark_progress(15)  # this node had finished step 15 before it failed
    results = _agree(tmp_path, 2)
    for step, source, _, lost, w in results.values():
        assert (step, source, lost) == (12, "durable", 3)
        assert w == [12.0] * 8


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_a_stale_cached_manifest_on_one_node_cannot_desync_the_group(tmp_path: Path) -> None:
    _commit(tmp_path, 10)
    shutil.copytree(tmp_path / "durable", tmp_path / "durable-view-0")  # rank 0's stale view
    _commit(tmp_path, 20)
    results = _agree(tmp_path, 2)
    assert {(r[0], r[1], r[2]) for r in results.values()} == {(20, "durable", 1)}
    assert all(r[4] == [20.0] * 8 for r in results.values())


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_torn_durable_head_falls_back_everywhere(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "durable")
    _commit(tmp_path, 6)
    newest = _commit(tmp_path, 8)
    store.put(newest.name, store.get(newest.name)[:100])
    results = _agree(tmp_path, 2)
    assert {(r[0], r[1]) for r in results.values()} == {(6, "durable")}
    assert all(r[4] == [6.0] * 8 for r in results.values())


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_a_torn_durable_head_is_read_once_then_every_rank_lowers_its_claim(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path / "durable")
    _commit(tmp_path, 6)
    torn = _commit(tmp_path, 8)
    store.put(torn.name, store.get(torn.name)[:100])
    results = _agree(tmp_path, 3)
    assert {(r[0], r[1]) for r in results.values()} == {(6, "durable")}
    # One holder learns it is torn and tells the rest; they do not each download it in turn.
    assert _object_reads(tmp_path, torn.name) == 1


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_an_unreachable_durable_store_does_not_stop_a_local_resume(tmp_path: Path) -> None:
    _commit(tmp_path, 5)
    _local(tmp_path, 1).save_state(9, _state(9))
    results = _agree(tmp_path, 2, unreachable=[0, 1])
    for step, source, holder, _, w in results.values():
        assert (step, source, holder) == (9, "local", 1)
        assert w == [9.0] * 8


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_a_holder_that_cannot_read_the_checkpoint_lets_the_next_rank_serve_it(
    tmp_path: Path,
) -> None:
    _commit(tmp_path, 5)
    results = _agree(tmp_path, 2, objects_unreadable=[0])
    for step, source, holder, _, w in results.values():
        assert (step, source, holder) == (5, "durable", 1)
        assert w == [5.0] * 8


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_nothing_readable_anywhere_refuses_to_start_from_step_zero(tmp_path: Path) -> None:
    _commit(tmp_path, 5)
    results = _agree(tmp_path, 2, unreachable=[0, 1])
    assert {r[0] for r in results.values()} == {"error"}
    assert all("refusing to start from step 0" in r[1] for r in results.values())


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_a_durable_checkpoint_of_another_model_stops_every_rank_with_no_fallback(
    tmp_path: Path,
) -> None:
    _commit(tmp_path, 3)  # this model's: an older one, which would fit
    other = {"step": 5, "w": torch.zeros(4)}  # another shape
    _checkpoints(FileStore(tmp_path / "durable"), tmp_path / "scratch").save_alone(other, 5)
    results = _agree(tmp_path, 2)
    assert {r[0] for r in results.values()} == {"error"}
    assert all("checkpoint of step 5" in r[1] and "does not fit" in r[1] for r in results.values())
    # The holder's failure is every rank's: no other rank downloads it again.
    assert not (tmp_path / "gets-1.log").exists()


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_a_slow_store_is_waited_for_on_the_checkpoint_group(tmp_path: Path) -> None:
    _commit(tmp_path, 5)
    # The holder (rank 0) reads for 5 s; the default group would give up after 2 s.
    results = _agree(
        tmp_path, 2, collective_timeout_s=2, slow_get_s={0: 5.0}, checkpoint_group=True
    )
    for step, source, holder, _, w in results.values():
        assert (step, source, holder) == (5, "durable", 0)
        assert w == [5.0] * 8


def test_node_local_directories_are_keyed_by_the_checkpoint_uri(tmp_path: Path) -> None:
    # Plain torchrun gives every job the rendezvous id "none".
    lineage = "0123456789abcdef0123456789abcdef"
    first = NodeLocalState(tmp_path, node_local_key("none", "/ckpt/job-a", lineage))
    second = NodeLocalState(tmp_path, node_local_key("none", "/ckpt/job-b", lineage))
    first.save_state(7, _state(7))
    assert second.load() is None and first.load() is not None
    assert node_local_key("none", "/ckpt/job-a/", lineage) == node_local_key(
        "none", "/ckpt/job-a", lineage
    )
    assert "/" not in node_local_key("a/b", "/c", lineage)


def test_a_local_save_of_another_run_identity_is_no_claim(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = {"global_batch_size": 8, "num_samples": 48}
    NodeLocalState(tmp_path, RUN).save_state(7, _state(7, run))
    assert NodeLocalState(tmp_path, RUN, expected_run=run).load() is not None
    other = NodeLocalState(tmp_path, RUN, expected_run={**run, "num_samples": 40})
    assert other.load() is None
    assert "ignoring the emergency save of step 7" in caplog.text


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_bad_manifest_entries_and_unreadable_bytes_fall_back_instead_of_crashing(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path / "durable")
    _commit(tmp_path, 5)
    # Step 7: a checkpoint whose objects verify, but are no DCP checkpoint this program reads.
    checkpoint_id = sharded_id(PREFIX, 7)
    garbage = b"verifies, but is no checkpoint this program can read"
    store.put(shard_name(checkpoint_id, 0, 0), garbage)
    listed = StoredFile(shard_name(checkpoint_id, 0, 0), len(garbage), sha256(garbage))
    repo = _checkpoints(store, tmp_path / "scratch").repository
    repo.commit(7, garbage, files=(listed,), name=metadata_name(checkpoint_id))
    # Newest: a manifest from elsewhere whose entry names a path outside the store.
    body = {
        "seq": 3,
        "entries": [{"name": "../x", "step": "9", "sha256": "0" * 64, "size": 1}],
        "writer": "x",
    }
    text = json.dumps(body, sort_keys=True)
    store.put(
        repo.manifest_name(3),
        json.dumps({"body": body, "sha256": hashlib.sha256(text.encode()).hexdigest()}).encode(),
    )
    results = _agree(tmp_path, 2)
    assert {(r[0], r[1]) for r in results.values()} == {(5, "durable")}
    assert all(r[4] == [5.0] * 8 for r in results.values())


def test_a_bug_is_not_taken_for_an_unreadable_store(tmp_path: Path) -> None:
    class Buggy(FileStore):
        def get(self, name: str) -> bytes:
            raise AttributeError("a bug, not the store")

    _commit(tmp_path, 5)
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10)
    )
    try:
        durable = _source(Buggy(tmp_path / "durable"), tmp_path / "scratch")
        with pytest.raises(AttributeError, match="a bug"):
            agree_on_resume(0, torch.device("cpu"), None, durable)
    finally:
        dist.destroy_process_group()


def test_the_holder_loads_a_durable_checkpoint_into_its_live_state(tmp_path: Path) -> None:
    """The holder reads a durable checkpoint item by item into the state it holds (DCP), never
    into a second copy of it, and a checkpoint one of whose files is torn is passed over."""
    _commit(tmp_path, 5)
    torn = _commit(tmp_path, 7)
    (tmp_path / "durable" / torn.files[0].name).write_bytes(b"torn")
    live = _state(0)
    checkpoints = _checkpoints(FileStore(tmp_path / "durable"), tmp_path / "scratch")
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10)
    )
    try:
        durable = DurableSource(checkpoints, lambda: live)
        resume = agree_on_resume(0, torch.device("cpu"), None, durable)
    finally:
        dist.destroy_process_group()
    assert (resume.step, resume.source) == (5, "durable")
    assert resume.state is not None and resume.state["w"] is live["w"]
    assert live["w"].tolist() == [5.0] * 8
