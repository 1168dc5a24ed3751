"""Durable checkpoints that stay correct with any number of writers: no rename, no overwrite.

Commit protocol:
1. write the state to a new, uniquely named object ``ckpt-<step>-<nonce>.pt``;
2. read it back and check its SHA-256 (a torn or short write fails here, before it counts);
3. publish a new manifest, ``ckpt-manifest-<seq>.json``, that names it and the older entries
   kept, with their checksums. A manifest is created once and never rewritten: the store's
   create-if-absent (Blob ``If-None-Match: *``; a hard link on a local filesystem) lets
   exactly one writer take each sequence number. A writer that loses the race reads the
   winner's manifest and tries again on top of it, so every manifest extends the one before
   it and two writers can never both believe they took sequence N+1.

Readers take the newest valid manifest and fall back, entry by entry, to older checkpoints
whose checksums verify. Why nothing acknowledged is lost (docs/training.md, "Checkpoints"):

- the head only moves forward: a manifest is built on its immediate predecessor, and a step
  older than a head that verifies is refused, not published;
- nothing the newest ``RETAINED_MANIFESTS`` manifests name is ever deleted;
- anything else may be another writer's commit between its upload and its manifest. It is
  deleted only once it is older than ``grace_s``, and a writer acknowledges a commit only
  when it published within ``grace_s / 2`` of its upload's end. So a pruner that could
  delete it began reading the manifests after the one naming it was visible.
  Manifests go the same way: one leaves the store only when two newer ones exist and it is
  older than ``grace_s``, so a writer that stalled cannot recreate a retired sequence number.

The store must answer listings and reads consistently (Blob's API and a local filesystem do;
a blobfuse2 mount does not, and cannot create-if-absent: ``FileStore`` refuses one).
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
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from training.storage import ObjectStore

logger = logging.getLogger(__name__)

RETAINED_MANIFESTS = 2
"""Everything the newest two manifests name stays: a late, unacknowledged publication (see
``commit``) can hide the acknowledged head from the newest manifest, never from both."""
GRACE_S = 120.0
"""How old an object no manifest names must be before it is deleted: ample for the clocks of
the nodes and the store to disagree, and for a commit's manifest to follow its upload."""
_OBJECT = re.compile(r"^(?P<prefix>[a-z]+)-(?P<step>\d{10})-[0-9a-f]{8}\.pt$")
_MANIFEST = re.compile(r"^(?P<prefix>[a-z]+)-manifest-(?P<seq>\d{10})\.json$")


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
    writer: str = field(default="", compare=False)
    """Which repository wrote it: for logs when a race is lost."""

    def encode(self) -> bytes:
        body = {
            "seq": self.seq,
            "entries": [asdict(e) for e in self.entries],
            "writer": self.writer,
        }
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
            return Manifest(int(body["seq"]), entries, str(body.get("writer", "")))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Loaded:
    entry: Entry
    data: bytes


class CheckpointRepository:
    """Checkpoints of one run in an object store, committed by an append-only manifest log.

    Any number of repositories, in any processes, may commit to one store at once.
    """

    def __init__(
        self,
        store: ObjectStore,
        keep: int = 3,
        prefix: str = "ckpt",
        grace_s: float = GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if grace_s <= 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.store = store
        self.keep = keep
        self.prefix = prefix
        self.grace_s = grace_s
        self._clock = clock
        self.writer = uuid.uuid4().hex[:8]
        # The background saver and an emergency save of this process publish one at a time.
        self._publish = threading.Lock()
        self._newest_published = -1

    # -- reading -------------------------------------------------------------------------------
    def manifest_name(self, seq: int) -> str:
        return f"{self.prefix}-manifest-{seq:010d}.json"

    def _listed_seqs(self) -> list[int]:
        seqs = []
        for name in self.store.list(f"{self.prefix}-manifest-"):
            match = _MANIFEST.match(name)
            if match and match["prefix"] == self.prefix:
                seqs.append(int(match["seq"]))
        return sorted(seqs)

    def _get_manifest(self, seq: int) -> Manifest | None:
        """Manifest ``seq``; None when it is torn. FileNotFoundError when there is none."""
        manifest = Manifest.decode(self.store.get(self.manifest_name(seq)))
        if manifest is None or manifest.seq != seq:
            logger.warning(
                "manifest %d in %s is torn or misnamed; ignoring it", seq, self.store.describe()
            )
            return None
        return manifest

    def _log(self, depth: int = 1) -> tuple[int, list[Manifest]]:
        """(the highest sequence taken, up to ``depth`` valid manifests, newest first).

        Manifests below the newest ``depth`` are read only when those are torn.
        """
        seqs = self._listed_seqs()
        top = seqs[-1] if seqs else 0
        # A listing may lag a create that a read already sees: look past its end.
        while True:
            try:
                self._get_manifest(top + 1)
            except FileNotFoundError:
                break
            top += 1
            seqs.append(top)
        found: list[Manifest] = []
        for seq in reversed(seqs):
            if len(found) >= depth:
                break
            try:
                manifest = self._get_manifest(seq)
            except FileNotFoundError:
                continue  # retired since the listing
            if manifest is not None:
                found.append(manifest)
        return top, found

    def manifest(self) -> Manifest | None:
        """The newest valid manifest, or None before the first commit."""
        _, manifests = self._log()
        return manifests[0] if manifests else None

    def head(self) -> Entry | None:
        """The newest checkpoint as the manifest claims it (reads nothing but the manifests)."""
        manifest = self.manifest()
        return manifest.entries[0] if manifest and manifest.entries else None

    def entries(self) -> list[Entry]:
        """Every checkpoint the retained manifests name, newest first: what pruning keeps."""
        _, manifests = self._log(depth=RETAINED_MANIFESTS)
        unique = {e.name: e for m in manifests for e in m.entries}
        return sorted(unique.values(), key=lambda e: e.step, reverse=True)

    def newest_verified(self) -> Entry | None:
        """The newest checkpoint in the store whose bytes match its checksum."""
        loaded = self.load_latest()
        return loaded.entry if loaded else None

    # -- committing ----------------------------------------------------------------------------
    def commit(self, step: int, data: bytes) -> Entry:
        """Write, verify, then publish a checkpoint; returns only once it is acknowledged.

        Raises CheckpointError, and acknowledges nothing, when a newer step that verifies is
        already the head (a stalled background save that finishes after the emergency save, or
        the other half of a split rendezvous, must not replace it), or when publishing took so
        long that a concurrent prune may have removed the object.
        """
        entry = Entry(
            f"{self.prefix}-{step:010d}-{uuid.uuid4().hex[:8]}.pt", step, sha256(data), len(data)
        )
        uploaded = self._write_verified(entry, data)
        with self._publish:
            # An error here leaves the object for pruning: a manifest may name it already
            # (a create whose answer was lost), and what a manifest names is never deleted.
            published = self._publish_entry(entry, uploaded)
            late = self._clock() - uploaded
            if published:
                self._newest_published = max(self._newest_published, step)
            self._prune()
        if published and late >= self.grace_s / 2:
            raise CheckpointError(
                f"checkpoint of step {step} was published {late:.0f} s after its upload, "
                f"past half the {self.grace_s:.0f} s grace; not counted as committed (a "
                "concurrent prune may have removed it)"
            )
        if not published:
            raise CheckpointError(
                f"checkpoint of step {step} is older than step {self._newest_published}, "
                f"already committed to {self.store.describe()}; dropped"
            )
        return entry

    def _write_verified(self, entry: Entry, data: bytes) -> float:
        """Write and read back ``entry``; the clock when the write returned.

        The store dates the object no later than that (its modification time), and the
        grace period runs from that date, whatever the size of the upload.
        """
        self.store.put(entry.name, data)
        uploaded = self._clock()
        if not self._verifies(entry):
            self.store.delete(entry.name)
            raise CheckpointError(
                f"checkpoint {entry.name} in {self.store.describe()} read back torn"
            )
        return uploaded

    def _discard(self, entry: Entry) -> None:
        """Delete an object of ours that no manifest names (best effort: pruning retries)."""
        try:
            self.store.delete(entry.name)
        except OSError as exc:
            logger.warning("could not delete unpublished %s: %s", entry.name, exc)

    def _publish_entry(self, entry: Entry, uploaded: float) -> bool:
        """Publish ``entry`` as the head on top of the newest manifest; False when stale.

        Stale is older than this process's last commit, or than a head that verifies: the head
        never goes back in time, not even when a second group writes to the same store. A
        head that fails its checksum may be replaced by an older step.
        """
        while True:
            if entry.step < self._newest_published:
                self._discard(entry)
                return False
            top, manifests = self._log()
            base = manifests[0] if manifests else None
            head = base.entries[0] if base and base.entries else None
            if head is not None and head.step > entry.step and self._verifies(head):
                self._newest_published = max(self._newest_published, head.step)
                self._discard(entry)
                return False
            if self._clock() - uploaded >= self.grace_s / 2:
                self._discard(entry)
                raise CheckpointError(
                    f"checkpoint of step {entry.step} could not be published within half the "
                    f"{self.grace_s:.0f} s grace of its upload; dropped"
                )
            older = [e for e in base.entries if e.step < entry.step] if base else []
            manifest = Manifest(top + 1, (entry, *older[: self.keep - 1]), self.writer)
            try:
                self.store.put_new(self.manifest_name(manifest.seq), manifest.encode())
            except FileExistsError:
                logger.info(
                    "manifest %d of %s was taken by another writer; publishing on top of it",
                    manifest.seq,
                    self.store.describe(),
                )
                continue
            return True

    def _verifies(self, entry: Entry) -> bool:
        """True when ``entry``'s object is in the store and matches its checksum."""
        try:
            return sha256(self.store.get(entry.name)) == entry.sha256
        except FileNotFoundError:
            return False

    def _prune(self) -> None:
        """Delete what is provably unreferenced (the module docstring says why it is safe)."""
        now = self.store.now()
        # Ages are read before the manifests: an object old enough now was old enough when
        # the manifests below were read, so any manifest naming it was visible to that read.
        objects = self.store.list_modified(self.prefix + "-")
        old = {name for name, modified in objects.items() if now - modified > self.grace_s}
        top, manifests = self._log(depth=RETAINED_MANIFESTS)
        named = {e.name for m in manifests if m.seq > top - RETAINED_MANIFESTS for e in m.entries}
        for name in sorted(old - named):
            if self._prunable(name, top):
                self.store.delete(name)

    def _prunable(self, name: str, top: int) -> bool:
        """Ours, and a checkpoint object or a manifest older than the retained ones."""
        if match := _OBJECT.match(name):
            return match["prefix"] == self.prefix
        if match := _MANIFEST.match(name):
            return match["prefix"] == self.prefix and int(match["seq"]) <= top - RETAINED_MANIFESTS
        return False

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
