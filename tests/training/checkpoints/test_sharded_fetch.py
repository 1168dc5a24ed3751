"""A restore brings each file it reads to local disk, verified against the manifest: linked and
hashed in place from a directory on the same filesystem (a rank's share of a large state read
once, not copied), streamed from any other store; a file that is torn or gone is refused either
way, and the store's own file is never touched. A file this node kept when it saved its part is
read from its own disk, verified the same way, and from the store when it is torn or gone."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from training.checkpoints.manifest import StoredFile
from training.checkpoints.sharded.reader import fetch, fetch_verified
from training.checkpoints.storage import FileStore

DATA = os.urandom(3 << 20) + b"tail"  # over HashingWriter's parallel threshold


def _stored(store: FileStore, name: str = "dcp-1__0_0.distcp") -> StoredFile:
    store.put(name, DATA)
    return StoredFile(name, len(DATA), hashlib.sha256(DATA).hexdigest())


def _no_links(monkeypatch: pytest.MonkeyPatch) -> None:
    def cross_device(source: object, target: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)


def test_a_directory_on_this_filesystem_is_linked_and_hashed_in_place(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    listed = _stored(store)
    local = tmp_path / "cache" / listed.name
    local.parent.mkdir()
    assert fetch_verified(store, listed, local) is None
    assert local.stat().st_ino == (store.root / listed.name).stat().st_ino  # no copy
    assert local.read_bytes() == DATA


def test_a_store_that_cannot_link_is_streamed_into_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path / "store")
    listed = _stored(store)
    _no_links(monkeypatch)
    local = tmp_path / listed.name
    assert fetch_verified(store, listed, local) is None
    assert local.stat().st_ino != (store.root / listed.name).stat().st_ino
    assert local.read_bytes() == DATA


@pytest.mark.parametrize("linked", [True, False], ids=["linked", "copied"])
def test_a_torn_or_missing_file_is_refused_and_the_stores_file_left_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linked: bool
) -> None:
    store = FileStore(tmp_path / "store")
    listed = _stored(store)
    if not linked:
        _no_links(monkeypatch)
    torn = DATA[: len(DATA) // 2]
    (store.root / listed.name).write_bytes(torn)
    local = tmp_path / listed.name
    problem = fetch_verified(store, listed, local)
    assert problem is not None and problem.startswith(f"is torn: {len(torn)} bytes")
    assert not local.exists()
    assert (store.root / listed.name).read_bytes() == torn
    gone = StoredFile("dcp-1__1_0.distcp", listed.size, listed.sha256)
    assert fetch_verified(store, gone, tmp_path / gone.name) == "is missing"
    assert not (tmp_path / gone.name).exists()


class _Unread(FileStore):
    """A store that must not be read: the node's own copy serves."""

    def get_into(self, name: str, sink: object) -> int:
        raise AssertionError(f"read {name} from the store")

    def link_into(self, name: str, path: Path) -> bool:
        raise AssertionError(f"read {name} from the store")


def test_a_file_this_node_kept_is_read_from_its_disk_not_the_store(tmp_path: Path) -> None:
    kept = FileStore(tmp_path / "kept", fsync=False)
    listed = _stored(kept)
    local = tmp_path / "cache" / listed.name
    local.parent.mkdir()
    assert fetch(_Unread(tmp_path / "store"), listed, local, kept) is None
    assert local.stat().st_ino == (kept.root / listed.name).stat().st_ino
    assert local.read_bytes() == DATA


def test_a_torn_or_missing_kept_copy_falls_back_to_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, kept = FileStore(tmp_path / "store"), FileStore(tmp_path / "kept", fsync=False)
    listed = _stored(store)
    (tmp_path / "kept" / listed.name).write_bytes(DATA[:100])  # torn on this node's disk
    local = tmp_path / listed.name
    with caplog.at_level("WARNING"):
        assert fetch(store, listed, local, kept) is None
    assert local.stat().st_ino == (store.root / listed.name).stat().st_ino
    assert f"this node's copy of {listed.name} is torn" in caplog.text
    local.unlink()
    (tmp_path / "kept" / listed.name).unlink()  # or gone: the store's, without a word
    caplog.clear()
    assert fetch(store, listed, local, kept) is None and caplog.text == ""
    torn = StoredFile(listed.name, listed.size + 1, listed.sha256)  # neither copy is whole
    assert fetch(store, torn, tmp_path / "again", kept).startswith("is torn")
