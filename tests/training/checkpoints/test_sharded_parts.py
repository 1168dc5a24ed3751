"""Parts: each rank saves its share of an FSDP2 state alone (no collective: its peers may be
gone), and the next round's coordinator joins only a whole world's parts into one checkpoint.
That the joined checkpoint loads, resharded, at another world size and resumes exactly is
tests/training/test_elastic_training_fsdp2.py's eviction (3 to 2) and join (2 to 3)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.sharded_runs import (
    SAVE_AT,
    SAVED_SEED,
    Run,
)
from tests.support.waiting import init_gloo, wait_until
from training.checkpoints.manifest import part_name
from training.checkpoints.sharded.parts import complete, part_set_id, save_part
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.storage import FileStore

PART_ID = part_set_id("dcp", SAVE_AT, "round-1")


def _checkpoints(base: Path, rank: int) -> ShardedCheckpoints:
    return ShardedCheckpoints(FileStore(base / "store"), base / f"scratch-{rank}")


def _save_parts(rank: int, world: int, root: str) -> None:
    """Every rank trains, then saves its part alone, the higher ranks first and gone before
    rank 0 saves: a collective inside ``save_part`` would find them missing."""
    base = Path(root)
    init_gloo(base / "init-save", rank, world)
    run = Run("fsdp2", SAVED_SEED, rank, world)
    run.train_to(SAVE_AT)
    torch.manual_seed(1234 + rank)
    if rank == 0:
        torch.save(torch.get_rng_state(), base / "rng.pt")
    dist.barrier()
    checkpoints = _checkpoints(base, rank)
    if rank != 0:
        save_part(checkpoints, run.state, PART_ID, SAVE_AT, rank, world)
        return  # no destroy_process_group: a peer that left says nothing either
    others = [base / "store" / part_name(PART_ID, r) for r in range(1, world)]
    wait_until(lambda: all(p.exists() for p in others), 120, "the other ranks' parts")
    part = save_part(checkpoints, run.state, PART_ID, SAVE_AT, rank, world)
    assert (part.rank, part.world, part.step) == (0, world, SAVE_AT)


class _EvictedMidCommit(FileStore):
    """The coordinator evicted as it commits: the merged metadata is up, no manifest is."""

    def put_new(self, name: str, data: bytes) -> None:
        raise OSError(f"put_new {name!r}: the node was evicted")


@pytest.mark.slow
@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(300)
def test_a_set_with_a_part_missing_or_torn_is_never_committed(tmp_path: Path) -> None:
    mp.spawn(_save_parts, args=(2, str(tmp_path)), nprocs=2)
    store = tmp_path / "store"
    kept = tmp_path / "kept"
    shutil.copytree(store, kept)
    (store / part_name(PART_ID, 1)).unlink()  # a node killed without notice
    assert complete(_checkpoints(tmp_path, 0), newer_than=-1) is None
    shutil.rmtree(store)
    shutil.copytree(kept, store)
    record = store / part_name(PART_ID, 0)
    record.write_bytes(record.read_bytes()[:-10])  # a record cut short
    assert complete(_checkpoints(tmp_path, 0), newer_than=-1) is None
    assert _checkpoints(tmp_path, 0).entries() == []  # nothing committed either time
    shutil.rmtree(store)
    shutil.copytree(kept, store)
    assert complete(_checkpoints(tmp_path, 0), newer_than=SAVE_AT) is None  # not newer
    cut = ShardedCheckpoints(_EvictedMidCommit(store), tmp_path / "scratch-0")
    with pytest.raises(OSError, match="evicted"):
        complete(cut, newer_than=SAVE_AT - 1)
    assert _checkpoints(tmp_path, 0).entries() == []  # not half committed
    # The next round's coordinator commits the same parts, once.
    entry = complete(_checkpoints(tmp_path, 0), newer_than=SAVE_AT - 1)
    assert entry is not None and entry.step == SAVE_AT and len(entry.files) == 2
    assert complete(_checkpoints(tmp_path, 0), newer_than=SAVE_AT - 1) is None
    assert _checkpoints(tmp_path, 0).entries() == [entry]


class _DiskFull(FileStore):
    def put(self, name: str, data: bytes | Path) -> int:
        raise OSError(28, "No space left on device")


def test_a_part_keeps_its_file_on_the_node_until_a_newer_part_is_saved(tmp_path: Path) -> None:
    # The next round's ranks on this node read the file from here, not from the store
    # (reader.py's fetch); each part saved replaces the older steps' copies.
    kept = FileStore(tmp_path / "kept", fsync=False)
    store = FileStore(tmp_path / "store")
    checkpoints = ShardedCheckpoints(store, tmp_path / "scratch", kept=kept)
    state = {"w": torch.arange(4096.0)}  # no_dist: no process group needed
    first = save_part(checkpoints, state, part_set_id("dcp", 1, "round-1"), 1, 0, 1)
    assert first.file is not None and kept.list() == [first.file.name]
    assert hashlib.sha256(kept.get(first.file.name)).hexdigest() == first.file.sha256
    second = save_part(checkpoints, state, part_set_id("dcp", 2, "round-2"), 2, 0, 1)
    assert second.file is not None and kept.list() == [second.file.name]
    assert store.size(first.file.name) == first.file.size  # the store's copy stays


def test_a_node_that_cannot_keep_its_part_still_saves_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileStore(tmp_path / "store")
    full = _DiskFull(tmp_path / "kept", fsync=False)
    checkpoints = ShardedCheckpoints(store, tmp_path / "scratch", kept=full)
    with caplog.at_level("WARNING"):
        part = save_part(checkpoints, {"w": torch.ones(8)}, PART_ID, SAVE_AT, 0, 1)
    assert part.file is not None and store.size(part.file.name) == part.file.size
    assert f"{part.file.name} is not kept on this node" in caplog.text
