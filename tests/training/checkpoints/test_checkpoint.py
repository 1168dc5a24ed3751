"""The checkpoint commit protocol, on both backends: torn writes, checksums, fallback, retention."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpoints.checkpoint import (
    GRACE_S,
    CheckpointError,
    CheckpointRepository,
    Entry,
    Manifest,
    deserialize,
    serialize,
    sha256,
    snapshot,
)
from training.checkpoints.lineage import store_lineage
from training.checkpoints.storage import FileStore, ObjectStore
from training.loop.saves.periodic import BackgroundSaver, SavePolicy


def _state(step: int) -> bytes:
    return serialize({"step": step, "w": torch.full((4,), float(step))})


def _repo(store: ObjectStore, keep: int = 3) -> CheckpointRepository:
    return CheckpointRepository(store, keep=keep)


def _writes(repo: CheckpointRepository) -> Callable[[int, Any], Entry]:
    """A saver's write that commits each snapshot to ``repo`` as one object."""
    return lambda step, state: repo.commit(step, serialize(state))


def test_commit_then_load_round_trips(object_store: ObjectStore) -> None:
    repo = _repo(object_store)
    assert repo.load_latest() is None and repo.head() is None
    repo.commit(5, _state(5))
    loaded = repo.load_latest()
    assert loaded is not None and loaded.entry.step == 5
    assert torch.equal(deserialize(loaded.data)["w"], torch.full((4,), 5.0))


def test_torn_newest_checkpoint_falls_back_to_previous(object_store: ObjectStore) -> None:
    repo = _repo(object_store)
    repo.commit(5, _state(5))
    newest = repo.commit(10, _state(10))
    data = object_store.get(newest.name)
    object_store.put(newest.name, data[: len(data) // 2])  # a torn write after commit
    loaded = repo.load_latest()
    assert loaded is not None and loaded.entry.step == 5


def test_bit_flip_fails_the_checksum(object_store: ObjectStore) -> None:
    repo = _repo(object_store)
    repo.commit(3, _state(3))
    newest = repo.commit(4, _state(4))
    data = bytearray(object_store.get(newest.name))
    data[len(data) // 2] ^= 0xFF
    object_store.put(newest.name, bytes(data))
    loaded = repo.load_latest()
    assert loaded is not None and loaded.entry.step == 3


def test_missing_newest_object_falls_back(object_store: ObjectStore) -> None:
    repo = _repo(object_store)
    repo.commit(1, _state(1))
    newest = repo.commit(2, _state(2))
    object_store.delete(newest.name)
    loaded = repo.load_latest()
    assert loaded is not None and loaded.entry.step == 1


def test_a_torn_manifest_falls_back_to_the_one_before(object_store: ObjectStore) -> None:
    repo = _repo(object_store)
    repo.commit(1, _state(1))
    repo.commit(2, _state(2))
    name = repo.manifest_name(repo.manifest().seq)
    object_store.put(name, object_store.get(name)[:-7])  # a manifest damaged in the store
    assert repo.head() is not None and repo.head().step == 1
    loaded = repo.load_latest()
    assert loaded is not None and loaded.entry.step == 1


class _TearingStore(FileStore):
    """Writes only half of every checkpoint object: a write that never completed."""

    def put(self, name: str, data: bytes | Path) -> int:
        return super().put(name, data[: len(data) // 2] if name.endswith(".pt") else data)


def test_a_torn_write_never_becomes_the_committed_checkpoint(tmp_path) -> None:
    good = _repo(FileStore(tmp_path))
    good.commit(7, _state(7))
    tearing = _repo(_TearingStore(tmp_path))
    with pytest.raises(CheckpointError, match="torn"):
        tearing.commit(8, _state(8))
    assert good.head() is not None and good.head().step == 7
    assert [n for n in FileStore(tmp_path).list("ckpt-") if n.endswith(".pt")] == [good.head().name]
    loaded = good.load_latest()
    assert loaded is not None and loaded.entry.step == 7


def _aged(store: ObjectStore) -> ObjectStore:
    """The store, seen from a clock far past the grace period: everything in it is old."""
    store.now = lambda: time.time() + 10 * GRACE_S  # type: ignore[method-assign]
    return store


def test_retention_keeps_last_n_and_prunes_the_rest(object_store: ObjectStore) -> None:
    repo = _repo(_aged(object_store), keep=2)
    for step in range(1, 6):
        repo.commit(step, _state(step))
    on_store = sorted(int(n.split("-")[1]) for n in object_store.list("ckpt-") if n.endswith(".pt"))
    # keep=2 in the newest manifest; the previous manifest still names one more.
    assert on_store == [3, 4, 5]
    assert [e.step for e in repo.manifest().entries] == [5, 4]
    manifests = [n for n in object_store.list("ckpt-manifest-")]
    assert manifests == [repo.manifest_name(4), repo.manifest_name(5)]


def test_nothing_younger_than_the_grace_period_is_pruned(object_store: ObjectStore) -> None:
    # Another writer's object, uploaded and not yet published, looks exactly like this.
    orphan = "ckpt-0000000009-0123abcd.pt"
    object_store.put(orphan, b"in flight")
    repo = _repo(object_store, keep=1)
    for step in range(1, 4):
        repo.commit(step, _state(step))
    assert orphan in object_store.list("ckpt-")
    _aged(object_store)
    repo.commit(4, _state(4))
    assert orphan not in object_store.list("ckpt-")


def test_retention_never_deletes_the_last_good_checkpoint(tmp_path) -> None:
    store = FileStore(tmp_path)
    repo = _repo(store, keep=1)
    first = repo.commit(1, _state(1))
    with pytest.raises(CheckpointError):
        _repo(_TearingStore(tmp_path), keep=1).commit(2, _state(2))
    assert store.get(first.name) and repo.load_latest().entry == first


def test_manifest_decode_rejects_garbage_and_tampering() -> None:
    manifest = Manifest(3, (Entry("ckpt-0000000001-00000000.pt", 1, sha256(b"x"), 1),))
    assert Manifest.decode(manifest.encode()) == manifest
    assert Manifest.decode(b"{not json") is None
    tampered = manifest.encode().replace(b'"seq": 3', b'"seq": 4')
    assert Manifest.decode(tampered) is None


def test_checkpoints_load_weights_only() -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled code ran",))

    import io

    buffer = io.BytesIO()
    torch.save({"x": Evil()}, buffer)
    with pytest.raises(Exception, match="[Ww]eights only"):
        deserialize(buffer.getvalue())


def test_snapshot_is_independent_of_the_live_tensors() -> None:
    live = {"model": {"w": torch.zeros(3)}, "opt": [torch.ones(2)], "step": 4}
    copy = snapshot(live)
    live["model"]["w"].add_(1)
    live["opt"][0].add_(1)
    assert torch.equal(copy["model"]["w"], torch.zeros(3))
    assert torch.equal(copy["opt"][0], torch.ones(2)) and copy["step"] == 4


@pytest.mark.parametrize(
    ("policy", "step", "last_step", "elapsed", "expected"),
    [
        (SavePolicy(10, 0), 10, 0, 0.0, True),
        (SavePolicy(10, 0), 11, 10, 0.0, False),
        (SavePolicy(10, 0), 10, 10, 0.0, False),
        (SavePolicy(0, 5.0), 3, 1, 5.0, True),
        (SavePolicy(0, 5.0), 3, 1, 4.9, False),
        (SavePolicy(0, 0), 100, 0, 1e9, False),
    ],
)
def test_save_policy(
    policy: SavePolicy, step: int, last_step: int, elapsed: float, expected: bool
) -> None:
    assert policy.should_save(step, last_step, 100.0, 100.0 + elapsed) is expected


def test_background_saver_skips_while_busy_and_commits(tmp_path) -> None:
    release = threading.Event()

    class SlowStore(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            if name.endswith(".pt"):
                release.wait(10)
            return super().put(name, data)

    saved: list[int] = []
    saver = BackgroundSaver(_writes(_repo(SlowStore(tmp_path))), lambda e, s: saved.append(e.step))
    assert saver.submit(1, {"w": torch.ones(1)})
    assert saver.busy and not saver.submit(2, {"w": torch.ones(1)})
    release.set()
    saver.wait()
    assert saved == [1] and _repo(FileStore(tmp_path)).head().step == 1


def test_a_commit_older_than_one_this_process_published_is_dropped(tmp_path) -> None:
    repo = _repo(FileStore(tmp_path))
    repo.commit(10, _state(10))
    with pytest.raises(CheckpointError, match="step 5 is older than step 10, already committed"):
        repo.commit(5, _state(5))
    assert repo.head().step == 10 and repo.load_latest().entry.step == 10
    assert [n for n in FileStore(tmp_path).list("ckpt-") if n.endswith(".pt")] == [repo.head().name]


def test_a_commit_behind_the_stores_head_uploads_nothing(tmp_path) -> None:
    # The log is read before the upload: on a slow store, or with gigabytes of state, a commit
    # that cannot become the head costs no upload.
    class Uploads(FileStore):
        def __init__(self, root: Path) -> None:
            super().__init__(root)
            self.puts: list[str] = []

        def put(self, name: str, data: bytes | Path) -> int:
            self.puts.append(name)
            return super().put(name, data)

    _repo(FileStore(tmp_path)).commit(8, _state(8))
    store = Uploads(tmp_path)
    with pytest.raises(CheckpointError, match="step 6 is older than step 8"):
        _repo(store).commit(6, _state(6))
    with pytest.raises(CheckpointError, match="step 8 is already committed"):
        _repo(store).commit(8, _state(8), newer_only=True)
    assert store.puts == []


class _Reads(FileStore):
    """Records each checkpoint object read back."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[str] = []

    def get(self, name: str) -> bytes:
        if name.endswith(".pt"):
            self.reads.append(name)
        return super().get(name)


def test_a_commit_behind_an_intact_head_never_downloads_the_head(tmp_path) -> None:
    # The head may be a whole state of tens of GB: its size in the store is what a writer
    # checks; readers still hash it before they load it.
    _repo(FileStore(tmp_path)).commit(8, _state(8))
    store = _Reads(tmp_path)
    with pytest.raises(CheckpointError, match="step 6 is older than step 8"):
        _repo(store).commit(6, _state(6))
    assert store.reads == []
    assert _repo(store).newest_intact().step == 8 and store.reads == []


def test_a_commit_may_replace_a_head_that_is_gone(tmp_path) -> None:
    store = FileStore(tmp_path)
    earlier_run = _repo(store, keep=1)
    earlier_run.commit(6, _state(6))
    store.delete(earlier_run.commit(8, _state(8)).name)
    assert earlier_run.newest_intact().step == 6
    resumed = _repo(store, keep=1)
    resumed.commit(7, _state(7))
    assert resumed.head().step == 7 and resumed.load_latest().entry.step == 7


def test_the_head_never_goes_back_when_another_group_writes_the_same_store(tmp_path) -> None:
    # A rendezvous that split in two: both groups commit to one store, one of them behind.
    ahead, behind = _repo(FileStore(tmp_path)), _repo(FileStore(tmp_path))
    behind.commit(4, _state(4))
    ahead.commit(8, _state(8))
    with pytest.raises(CheckpointError, match="step 6 is older than step 8"):
        behind.commit(6, _state(6))
    assert [e.step for e in ahead.entries()] == [8, 4]
    behind.commit(9, _state(9))  # once past the head, its commits count again
    assert [e.step for e in ahead.entries()] == [9, 8, 4]


def test_a_newer_step_can_follow_a_torn_head_from_another_process(tmp_path) -> None:
    store = FileStore(tmp_path)
    earlier_run = _repo(store, keep=1)
    earlier_run.commit(6, _state(6))
    torn = earlier_run.commit(8, _state(8))
    store.put(torn.name, store.get(torn.name)[:50])
    resumed = _repo(store, keep=1)  # resumes at 6 (8 is torn) and trains on to 7
    resumed.commit(7, _state(7))
    assert resumed.head().step == 7 and resumed.load_latest().entry.step == 7


def test_a_stalled_background_save_neither_blocks_nor_displaces_the_emergency_save(
    tmp_path,
) -> None:
    stalled, release = threading.Event(), threading.Event()

    class StallsBeforePublishing(FileStore):
        """The background save's object is written, then the store stalls it before its
        manifest (a Blob call hanging until its timeout)."""

        def list(self, prefix: str = "") -> list[str]:
            if threading.current_thread().name == "checkpoint" and prefix.endswith("manifest-"):
                stalled.set()
                release.wait(30)
            return super().list(prefix)

    repo = _repo(StallsBeforePublishing(tmp_path))
    saver = BackgroundSaver(_writes(repo), lambda entry, seconds: None)
    saver.submit(4, {"w": torch.ones(1)})
    assert stalled.wait(10)
    emergency = threading.Thread(target=repo.commit, args=(8, _state(8)), name="emergency")
    emergency.start()
    emergency.join(20)  # a bound for the failure only: unblocked, it takes milliseconds
    try:
        assert not emergency.is_alive(), "the emergency commit queued behind the stalled save"
        assert saver.busy and repo.head().step == 8
    finally:
        release.set()
    assert saver.wait(10)
    # Refused as stale, which is no failure: a newer step is durable.
    assert saver.error is None and saver.failures == 0
    assert repo.head().step == 8 and repo.load_latest().entry.step == 8
    assert len([n for n in FileStore(tmp_path).list("ckpt-") if n.endswith(".pt")]) == 1


def test_background_saver_wait_is_bounded(tmp_path) -> None:
    release = threading.Event()

    class Stalled(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            release.wait(10)
            return super().put(name, data)

    saver = BackgroundSaver(_writes(_repo(Stalled(tmp_path))), lambda entry, seconds: None)
    saver.submit(1, {"w": torch.ones(1)})
    assert saver.wait(0.2) is False and saver.busy
    release.set()
    assert saver.wait(10) is True


def test_a_checkpoint_deleted_during_its_download_falls_back_to_the_previous_one(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from azure.storage.blob import ContainerClient

    from training.checkpoints.blob_store import BlobStore

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    # Small ranges, so that the download of the newest checkpoint takes several requests.
    store = BlobStore.from_uri(f"{blob_container_uri}/run", max_single_get_bytes=16 * 1024)
    repo = _repo(store)
    repo.commit(1, serialize({"w": torch.zeros(40_000)}))
    newest = repo.commit(2, serialize({"w": torch.ones(40_000)}))
    other_writer = ContainerClient.from_connection_string(
        azurite, blob_container_uri.rsplit("/", 1)[1]
    )
    download = store._container.download_blob

    def first_range_then_deleted(blob: str, **kwargs: object) -> object:
        downloader = download(blob, **kwargs)  # the first range is in
        if blob.endswith(newest.name):
            other_writer.delete_blob(blob)  # e.g. pruned by another writer
        return downloader

    monkeypatch.setattr(store._container, "download_blob", first_range_then_deleted)
    loaded = repo.load_latest()
    assert loaded is not None and loaded.entry.step == 1


def test_a_slow_upload_still_commits_the_grace_runs_from_its_end(tmp_path) -> None:
    # A large checkpoint takes longer to upload than half the grace period: the store dates
    # the object when the upload ends, and so does the deadline for its manifest.
    class SlowUploads(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            time.sleep(0.6)
            return super().put(name, data)

    repo = CheckpointRepository(SlowUploads(tmp_path), grace_s=1.0)
    assert repo.commit(1, _state(1)).step == 1
    assert repo.load_latest().entry.step == 1


def test_a_manifest_published_too_late_is_not_acknowledged(tmp_path) -> None:
    class SlowManifests(FileStore):
        def put_new(self, name: str, data: bytes) -> None:
            time.sleep(0.6)
            super().put_new(name, data)

    with pytest.raises(CheckpointError, match="past half the 1 s grace; not counted"):
        CheckpointRepository(SlowManifests(tmp_path), grace_s=1.0).commit(1, _state(1))


# --- Pruning and manifests that do not decode --------------------------------------------------


def test_pruning_keeps_the_newest_valid_manifests_when_newer_ones_do_not_decode(
    object_store: ObjectStore,
) -> None:
    repo = _repo(_aged(object_store), keep=1)
    repo.commit(1, _state(1))
    repo.commit(2, _state(2))
    # Two newer manifests this version cannot read (torn, or from another version).
    object_store.put(repo.manifest_name(3), b'{"body": {"seq": 3}, "sha256": "0"}')
    object_store.put(repo.manifest_name(4), b"{not json")
    repo.prune()
    loaded = repo.load_latest()
    assert loaded is not None and loaded.entry.step == 2
    assert repo.manifest_name(2) in object_store.list("ckpt-manifest-")


def _manifest_with(entry: dict, seq: int) -> bytes:
    """A manifest whose checksum is right but whose entry is whatever the test says."""
    body = {"seq": seq, "entries": [entry], "writer": "other"}
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"body": body, "sha256": sha256(text.encode())}).encode()


_GOOD = {"name": "ckpt-0000000005-0123abcd.pt", "step": 5, "sha256": "0" * 64, "size": 10}


@pytest.mark.parametrize(
    "bad",
    [
        {**_GOOD, "step": "5"},
        {**_GOOD, "step": True},
        {**_GOOD, "step": -1},
        {**_GOOD, "name": "../x"},
        {**_GOOD, "name": "ckpt/0000000005-0123abcd.pt"},
        {**_GOOD, "name": "ckpt-0000000006-0123abcd.pt"},
        {**_GOOD, "name": 5},
        {**_GOOD, "sha256": "ZZ"},
        {**_GOOD, "size": -3},
        {**_GOOD, "size": 1.5},
        {**_GOOD, "extra": 1},
        {k: v for k, v in _GOOD.items() if k != "size"},
        ["ckpt-0000000005-0123abcd.pt", 5],
    ],
)
def test_a_manifest_with_a_bad_entry_is_skipped_never_fatal(
    object_store: ObjectStore, bad: object
) -> None:
    repo = _repo(object_store)
    repo.commit(2, _state(2))  # manifest 1
    object_store.put(repo.manifest_name(2), _manifest_with(bad, 2))  # type: ignore[arg-type]
    assert Manifest.decode(object_store.get(repo.manifest_name(2))) is None
    assert repo.head().step == 2  # the bad manifest is skipped: the one before it counts
    assert repo.load_latest().entry.step == 2
    repo.commit(3, _state(3))  # and a writer publishes on top of the taken number
    assert repo.load_latest().entry.step == 3 and repo.manifest().seq == 3


def test_a_valid_entry_round_trips_and_entries_must_be_newest_first() -> None:
    assert Entry.from_json(_GOOD) == Entry(**_GOOD)
    older = {**_GOOD, "name": "ckpt-0000000004-0123abcd.pt", "step": 4}
    assert Manifest.decode(_manifest_with(_GOOD, 1)) is not None
    body = {"seq": 1, "entries": [older, _GOOD], "writer": ""}
    text = json.dumps(body, sort_keys=True)
    data = json.dumps({"body": body, "sha256": sha256(text.encode())}).encode()
    assert Manifest.decode(data) is None


# --- The lineage id ---------------------------------------------------------------------------


def test_the_lineage_is_created_once_and_renewed_only_when_the_store_is_emptied(
    object_store: ObjectStore,
) -> None:
    first = store_lineage(object_store)
    assert store_lineage(object_store) == first  # another rank, another process
    _repo(object_store).commit(1, _state(1))
    _repo(object_store).prune()
    assert store_lineage(object_store) == first  # never pruned
    for name in object_store.list():
        object_store.delete(name)  # the container emptied by hand
    assert store_lineage(object_store) != first


def test_a_lineage_record_that_is_not_one_is_a_clear_error(tmp_path) -> None:
    store = FileStore(tmp_path)
    store.put("ckpt-lineage.json", b"garbage")
    with pytest.raises(CheckpointError, match="ckpt-lineage.json .* is not a lineage record"):
        store_lineage(store)


def test_a_manifest_that_cannot_be_published_in_time_is_not_published_at_all(tmp_path) -> None:
    # Half the grace after the upload, another writer's prune may already have seen the object
    # unnamed and old: publishing it then could make the head a checkpoint that is gone. Here
    # another writer takes the manifest's number during the upload, and reading the log again
    # stalls the writer between its upload and its manifest.
    now = [0.0]
    other = CheckpointRepository(FileStore(tmp_path), grace_s=10.0, clock=lambda: now[0])

    class SlowBeforePublishing(FileStore):
        uploaded = False

        def put(self, name: str, data: bytes | Path) -> int:
            written = super().put(name, data)
            if name.endswith(".pt") and not self.uploaded:
                self.uploaded = True
                other.commit(0, _state(0))
            return written

        def list_modified(self, prefix: str = "") -> dict[str, float]:
            if prefix == "ckpt-manifest-" and self.uploaded:
                now[0] += 6.0
            return super().list_modified(prefix)

    store = SlowBeforePublishing(tmp_path)
    repo = CheckpointRepository(store, grace_s=10.0, clock=lambda: now[0])
    with pytest.raises(CheckpointError, match="could not be published within half the 10 s"):
        repo.commit(1, _state(1))
    assert [e.step for e in repo.entries()] == [0]  # only the other writer's
    assert [n for n in store.list("ckpt-") if n.endswith(".pt")] == [repo.entries()[0].name]


def test_a_manifest_remembered_as_missing_never_sends_the_head_back(tmp_path) -> None:
    class RemembersMissing(FileStore):
        """A cache that answers "not found" for a name it once found missing, a few times."""

        def __init__(self, root, answers: int) -> None:
            super().__init__(root)
            self.remembered: dict[str, int] = {}
            self.answers = answers

        def get(self, name: str) -> bytes:
            if self.remembered.get(name, 0) > 0:
                self.remembered[name] -= 1
                raise FileNotFoundError(name)
            try:
                return super().get(name)
            except FileNotFoundError:
                self.remembered[name] = self.answers
                raise

    ahead = _repo(FileStore(tmp_path), keep=1)
    behind = _repo(RemembersMissing(tmp_path, answers=5), keep=1)
    ahead.commit(1, _state(1))
    assert behind.head().step == 1  # and its cache now remembers manifest 2 as missing
    ahead.commit(3, _state(3))  # manifest 2: listed, but "missing" to the cache a while
    with pytest.raises(CheckpointError, match="step 2 is older than step 3"):
        behind.commit(2, _state(2))
    assert ahead.head().step == 3 and ahead.load_latest().entry.step == 3


def test_an_upload_longer_than_the_grace_never_publishes_a_retired_manifest_number(
    tmp_path,
) -> None:
    # The writer reads the log (manifest 1 is free) and uploads. Meanwhile another writer
    # publishes manifests 1 to 4, and its prune retires 1 and 2, older than the grace by then.
    # Manifest 1 is free again: published there, the commit would be acknowledged and no
    # reader, who takes the newest manifests, would ever see it.
    now = [0.0]
    other = CheckpointRepository(_aged(FileStore(tmp_path)), keep=1)

    class SlowUpload(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            if name.endswith(".pt") and now[0] == 0.0:
                for step in range(1, 5):
                    other.commit(step, _state(step))
                now[0] += 25.0  # the upload took 2.5 times the grace
            return super().put(name, data)

    repo = CheckpointRepository(SlowUpload(tmp_path), grace_s=10.0, clock=lambda: now[0])
    repo.commit(10, _state(10), prune=False)
    assert _repo(FileStore(tmp_path)).load_latest().entry.step == 10
