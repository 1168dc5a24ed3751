"""Durable checkpoints that stay correct on blobfuse2 and Blob Storage: no rename, ever.

Commit protocol:
1. write the state to a new, uniquely named object ``ckpt-<step>-<nonce>.pt``;
2. read it back and check its SHA-256 (a torn or short write fails here, before it counts);
3. write the manifest that names it (and the older ones kept) with their checksums.

Two manifests (A and B) are written alternately, each carrying a sequence number and its own
checksum. A torn manifest write therefore leaves the other one intact, and readers take the
valid manifest with the highest sequence. Only objects that no valid manifest names are deleted,
so the last good checkpoint is never lost. Loading verifies each checksum and falls back to the
previous entry when the newest is torn.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from training.storage import ObjectStore

logger = logging.getLogger(__name__)

MANIFESTS = ("manifest-a.json", "manifest-b.json")
_NAME = re.compile(r"^(?P<prefix>[a-z]+)-(?P<step>\d{10})-[0-9a-f]{8}\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no valid one could be read."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def serialize(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize(data: bytes) -> dict[str, Any]:
    # weights_only: a checkpoint on shared storage is data, never code to unpickle.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint, as its manifest names it."""

    name: str
    step: int
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    seq: int
    entries: tuple[Entry, ...]
    """Newest first."""

    def encode(self) -> bytes:
        body = {"seq": self.seq, "entries": [asdict(e) for e in self.entries]}
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": body, "sha256": sha256(text.encode())}).encode()

    @staticmethod
    def decode(data: bytes) -> Manifest | None:
        """The manifest, or None when it is torn or not ours."""
        try:
            outer = json.loads(data)
            body = outer["body"]
            if sha256(json.dumps(body, sort_keys=True).encode()) != outer["sha256"]:
                return None
            entries = tuple(Entry(**e) for e in body["entries"])
            return Manifest(seq=int(body["seq"]), entries=entries)
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Loaded:
    entry: Entry
    data: bytes


class CheckpointRepository:
    """Checkpoints of one run in an object store, committed by manifest."""

    def __init__(self, store: ObjectStore, keep: int = 3, prefix: str = "ckpt") -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store = store
        self.keep = keep
        self.prefix = prefix
        self.manifests = tuple(f"{prefix}-{m}" for m in MANIFESTS)
        # The background saver and an emergency save may commit at the same time: the
        # manifest's read-modify-write and the pruning must not interleave, and pruning must
        # not delete an object that another commit has written but not yet published.
        self._publish = threading.Lock()
        self._in_flight: set[str] = set()
        self._newest_published = -1

    def _read_manifests(self) -> list[Manifest]:
        found = []
        for name in self.manifests:
            try:
                manifest = Manifest.decode(self.store.get(name))
            except FileNotFoundError:
                continue
            if manifest is None:
                logger.warning(
                    "manifest %s in %s is torn; using the other", name, self.store.describe()
                )
            else:
                found.append(manifest)
        return sorted(found, key=lambda m: m.seq, reverse=True)

    def manifest(self) -> Manifest | None:
        """The newest valid manifest, or None before the first commit."""
        manifests = self._read_manifests()
        return manifests[0] if manifests else None

    def head(self) -> Entry | None:
        """The newest checkpoint as the manifest claims it (reads nothing but the manifest)."""
        manifest = self.manifest()
        return manifest.entries[0] if manifest and manifest.entries else None

    def entries(self) -> list[Entry]:
        """Every checkpoint a valid manifest names, newest first."""
        unique = {e.name: e for m in self._read_manifests() for e in m.entries}
        return sorted(unique.values(), key=lambda e: e.step, reverse=True)

    def commit(self, step: int, data: bytes) -> Entry:
        """Write, verify, then publish a checkpoint; prune what no valid manifest names.

        Raises CheckpointError, and publishes nothing, when this process has already
        published a newer step: a stalled background save that finishes after the emergency
        save must not replace it as the head.
        """
        entry = Entry(
            f"{self.prefix}-{step:010d}-{uuid.uuid4().hex[:8]}.pt", step, sha256(data), len(data)
        )
        with self._publish:
            self._in_flight.add(entry.name)
        try:
            self._write_verified(entry, data)
        except BaseException:
            with self._publish:
                self._in_flight.discard(entry.name)
            raise
        with self._publish:
            try:
                published = self._publish_entry(entry)
            finally:
                self._in_flight.discard(entry.name)  # named by a manifest now, or prunable
            self._prune()
        if not published:
            raise CheckpointError(
                f"checkpoint of step {step} is older than step {self._newest_published}, "
                f"already committed to {self.store.describe()}; dropped"
            )
        return entry

    def _write_verified(self, entry: Entry, data: bytes) -> None:
        self.store.put(entry.name, data)
        if not self._verifies(entry):
            self.store.delete(entry.name)
            raise CheckpointError(
                f"checkpoint {entry.name} in {self.store.describe()} read back torn"
            )

    def _publish_entry(self, entry: Entry) -> bool:
        """Make ``entry`` the head (older entries stay, up to ``keep``); False when stale.

        Stale is older than this process's last commit, or than a valid head in the store: the
        head never goes back in time, not even when a second group writes to the same store (a
        rendezvous that split in two). A torn head may be replaced by an older step.
        """
        if entry.step < self._newest_published:
            return False
        previous = self.manifest()
        head = previous.entries[0] if previous and previous.entries else None
        if head is not None and head.step > entry.step and self._verifies(head):
            self._newest_published = head.step
            return False
        older = [e for e in previous.entries if e.step < entry.step] if previous else []
        manifest = Manifest(
            seq=(previous.seq + 1) if previous else 1, entries=(entry, *older[: self.keep - 1])
        )
        self.store.put(self.manifests[manifest.seq % 2], manifest.encode())
        self._newest_published = entry.step
        return True

    def _verifies(self, entry: Entry) -> bool:
        """True when ``entry``'s object is in the store and matches its checksum."""
        try:
            return sha256(self.store.get(entry.name)) == entry.sha256
        except FileNotFoundError:
            return False

    def _prune(self) -> None:
        named = {e.name for m in self._read_manifests() for e in m.entries} | self._in_flight
        for name in self.store.list(self.prefix + "-"):
            if _NAME.match(name) and name not in named:
                self.store.delete(name)

    def load_latest(self) -> Loaded | None:
        """The newest checkpoint whose checksum verifies, falling back to older ones."""
        for entry in self.entries():
            try:
                data = self.store.get(entry.name)
            except FileNotFoundError:
                logger.warning("checkpoint %s is missing; trying the previous one", entry.name)
                continue
            if sha256(data) == entry.sha256:
                return Loaded(entry, data)
            logger.warning(
                "checkpoint %s fails its checksum (torn); trying the previous one", entry.name
            )
        return None


def snapshot(obj: Any) -> Any:
    """A CPU copy of every tensor in a state tree, so training can go on while it is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


@dataclass(frozen=True)
class SavePolicy:
    """When rank 0 writes a durable checkpoint."""

    every_steps: int = 100
    every_seconds: float = 0.0

    def should_save(self, step: int, last_step: int, last_time: float, now: float) -> bool:
        if step <= last_step:
            return False
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and now - last_time >= self.every_seconds


class BackgroundSaver:
    """Serialises and commits snapshots on one background thread; the loop only copies.

    A save that comes due while the previous one is still being written is skipped, not
    queued: the next one supersedes it and the loop never waits on storage.
    """

    def __init__(
        self, repository: CheckpointRepository, on_saved: Callable[[Entry, float], None]
    ) -> None:
        self.repository = repository
        self.on_saved = on_saved
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, state: dict[str, Any]) -> bool:
        """Start writing ``state`` (already a snapshot); False when a save is still running."""
        if self.busy:
            return False
        self._thread = threading.Thread(
            target=self._write, args=(step, state), name="checkpoint", daemon=True
        )
        self._thread.start()
        return True

    def _write(self, step: int, state: dict[str, Any]) -> None:
        started = time.monotonic()
        try:
            entry = self.repository.commit(step, serialize(state))
        except Exception as exc:  # storage errors must not kill training; the next save retries
            self.error = exc
            logger.error("checkpoint at step %d failed: %s", step, exc)
            return
        self.on_saved(entry, time.monotonic() - started)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the save in flight (if any) is done, or ``timeout_s`` has passed.

        True when no save is running any more (committed or failed), False on timeout.
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.busy
