"""Concurrent writers on one checkpoint store never lose an acknowledged commit.

Two writers on one store are not exotic: an evicted rank 0 finishing its durable save inside
its notice while the new group's rank 0 commits, or the two halves of a split rendezvous.
Each test runs writers in separate processes, each with its own ``CheckpointRepository`` on
the same store, committing interleaved, increasing steps through a store that sleeps a random
while before and after every operation (as Blob does under load), with a grace period short
enough that pruning runs during the test. After they stop, the newest checkpoint that
verifies must be at least the newest step any writer was told was committed, every time.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from training.checkpoint import CheckpointError, CheckpointRepository
from training.storage import FileStore, ObjectStore

WRITERS = 3
COMMITS_PER_WRITER = 12
GRACE_S = 1.5
"""Short, so that pruning deletes while the writers still run; far above the delays."""
MAX_DELAY_S = 0.015


class JitteryStore:
    """Delegates to a store, sleeping a random while before and after every operation."""

    def __init__(self, inner: ObjectStore, seed: int, max_delay_s: float = MAX_DELAY_S) -> None:
        self.inner = inner
        self.random = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.races_lost = 0
        """Creates refused because another writer took the name first."""

    def _jitter(self) -> None:
        time.sleep(self.random.uniform(0, self.max_delay_s))

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if name == "describe" or not callable(method):
            return method

        def jittered(*args: Any, **kwargs: Any) -> Any:
            self._jitter()
            try:
                return method(*args, **kwargs)
            except FileExistsError:
                self.races_lost += 1
                raise
            finally:
                self._jitter()

        return jittered


class StaleStore:
    """A store seen through a per-node cache, as on a blobfuse2 mount: listings are up to
    ``staleness_s`` old, and a name once found missing stays missing that long.

    Creates still go to the store itself, atomically (the Blob API), as do the reads of a
    name not yet cached: what a mount's cache cannot serve stale is a name it never saw.
    """

    def __init__(self, inner: ObjectStore, staleness_s: float) -> None:
        self.inner = inner
        self.staleness_s = staleness_s
        self._listing: tuple[float, dict[str, float]] | None = None
        self._missing: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        now = time.monotonic()
        if self._listing is None or now - self._listing[0] > self.staleness_s:
            self._listing = (now, self.inner.list_modified(""))
        return {k: v for k, v in self._listing[1].items() if k.startswith(prefix)}

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_modified(prefix))

    def get(self, name: str) -> bytes:
        cached = self._missing.get(name)
        if cached is not None and time.monotonic() - cached < self.staleness_s:
            raise FileNotFoundError(name)
        try:
            return self.inner.get(name)
        except FileNotFoundError:
            self._missing[name] = time.monotonic()
            raise


def _writer(
    open_store: Callable[[], ObjectStore], index: int, acks: Path, seed: int, stale_s: float
) -> None:
    jittery = JitteryStore(open_store(), seed)
    store: Any = StaleStore(jittery, stale_s) if stale_s else jittery
    repository = CheckpointRepository(store, keep=1, grace_s=GRACE_S)
    payload = random.Random(seed).randbytes(48 * 1024)
    for step in range(index + 1, WRITERS * COMMITS_PER_WRITER + 1, WRITERS):
        try:
            entry = repository.commit(step, payload + step.to_bytes(8, "big"))
        except CheckpointError:
            continue  # refused (stale or late): not acknowledged, so nothing is owed
        with open(acks, "a") as f:
            f.write(f"{entry.step}\n")
    with open(f"{acks}.races", "a") as f:
        f.write(f"{jittery.races_lost}\n")


def _run_writers(
    open_store: Callable[[], ObjectStore], work: Path, seed: int, stale_s: float = 0.0
) -> int:
    """Run the writers to completion; the newest step any of them had acknowledged."""
    return _run(open_store, work, seed, stale_s)[0]


def _run(
    open_store: Callable[[], ObjectStore], work: Path, seed: int, stale_s: float = 0.0
) -> tuple[int, int]:
    """(the newest step acknowledged, how many manifest creates lost a race)."""
    context = multiprocessing.get_context("fork")
    acks = work / f"acks-{seed}"
    processes = [
        context.Process(target=_writer, args=(open_store, i, acks, seed * 10 + i, stale_s))
        for i in range(WRITERS)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0, f"a writer failed (exit {process.exitcode})"
    acknowledged = [int(line) for line in acks.read_text().split()] if acks.exists() else []
    assert acknowledged, "no commit was acknowledged: the test proved nothing"
    races = sum(int(line) for line in Path(f"{acks}.races").read_text().split())
    return max(acknowledged), races


def _assert_nothing_acknowledged_is_lost(store: ObjectStore, acknowledged: int) -> None:
    loaded = CheckpointRepository(store, keep=1, grace_s=GRACE_S).load_latest()
    assert loaded is not None and loaded.entry.step >= acknowledged, (
        f"step {acknowledged} was acknowledged, but the newest checkpoint that verifies is "
        f"{loaded.entry.step if loaded else None}"
    )


def _file_opener(root: Path) -> Callable[[], ObjectStore]:
    return lambda: FileStore(root)


def _blob_opener(uri: str) -> Callable[[], ObjectStore]:
    def open_blob() -> ObjectStore:
        from training.blob_store import BlobStore

        return BlobStore.from_uri(uri)

    return open_blob


@pytest.mark.parametrize("seed", range(12))
def test_concurrent_writers_on_a_directory_lose_nothing(tmp_path: Path, seed: int) -> None:
    opener = _file_opener(tmp_path / "store")
    acknowledged = _run_writers(opener, tmp_path, seed)
    _assert_nothing_acknowledged_is_lost(opener(), acknowledged)


@pytest.mark.parametrize("seed", range(6))
def test_concurrent_writers_on_blob_storage_lose_nothing(
    azurite: str,
    blob_container_uri: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    seed: int,
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    opener = _blob_opener(f"{blob_container_uri}/run")
    acknowledged = _run_writers(opener, tmp_path, seed)
    _assert_nothing_acknowledged_is_lost(opener(), acknowledged)


@pytest.mark.parametrize("seed", range(6))
def test_writers_with_stale_listings_and_lookups_lose_nothing(tmp_path: Path, seed: int) -> None:
    # Staleness well under half the grace period: the bound the protocol states.
    opener = _file_opener(tmp_path / "store")
    acknowledged = _run_writers(opener, tmp_path, seed, stale_s=GRACE_S / 5)
    _assert_nothing_acknowledged_is_lost(opener(), acknowledged)


def test_the_writers_really_race_for_manifests(tmp_path: Path) -> None:
    # The tests above prove something only if writers contend for the same sequence number.
    _, races = _run(_file_opener(tmp_path / "store"), tmp_path, seed=99)
    assert races > 0
