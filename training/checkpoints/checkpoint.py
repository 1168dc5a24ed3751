"""Durable checkpoints that stay correct with any number of writers: no rename, no overwrite.

Commit protocol, after one read of the manifest log (a stale checkpoint uploads nothing):
1. write the state to a new, uniquely named object ``ckpt-<step>-<nonce>.pt``;
2. check the store's receipt for it: the size the store now holds under that name (on Blob
   also every request's Content-MD5, which the service checks before it keeps a byte:
   ``training/checkpoints/blob_store.py``). A torn or short write fails here, before it counts,
   without reading the object back: a read-back of a large model would take longer than an
   eviction's notice allows. Bytes damaged later in the store are what readers' checksums catch;
3. publish a new manifest, ``ckpt-manifest-<seq>.json``, that names it and the older entries
   kept, with their checksums. A manifest is created once and never rewritten: the store's
   create-if-absent (Blob ``If-None-Match: *``; a hard link on a local filesystem) lets
   exactly one writer take each sequence number. A writer that loses the race reads the
   winner's manifest and tries again on top of it: every manifest extends the one before it.

Pruning runs after a commit is acknowledged, never between the upload and its manifest, and
the eviction's commit skips it. Readers take the newest valid manifest and fall back, entry by
entry, to older checkpoints whose checksums verify. Why nothing acknowledged is lost
(docs/training.md, "Checkpoints"):

- the head only moves forward: a manifest is built on its immediate predecessor, and a step
  older than a head that verifies is refused, not published;
- nothing the newest ``RETAINED_MANIFESTS`` *valid* manifests name is ever deleted;
- anything else may be another writer's commit between its upload and its manifest. It is
  deleted only once it is older than ``grace_s``, and a writer acknowledges a commit only
  when it published within ``grace_s / 2`` of its upload's end and of the log read its
  manifest builds on. So a pruner that could delete it began reading the manifests after
  the one naming it was visible.
  Manifests go the same way: one leaves the store only when two newer ones exist, it is
  older than the retained valid ones, and it is older than ``grace_s``. A number free at a
  read less than ``grace_s / 2`` old was never retired, so a writer that stalled (in its
  upload, say) reads the log again and cannot recreate a retired sequence number.

Writers in one process are like writers in two: the protocol needs no lock between them, so
an eviction's commit never waits for a periodic save stuck in the store.

The store must answer listings and reads consistently (Blob's API and a local filesystem do;
a blobfuse2 mount does not, and cannot create-if-absent: ``FileStore`` refuses one).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from training.checkpoints.deadline import Deadline, DeadlineExceeded
from training.checkpoints.manifest import (
    CheckpointError,
    Entry,
    Fence,
    Loaded,
    LogRead,
    Manifest,
    StaleCheckpoint,
    StoredFile,
    manifest_name,
    manifest_seq,
    object_name,
    sha256,
    unreferenced,
)
from training.checkpoints.serialization import Payload, deserialize, serialize, snapshot
from training.checkpoints.storage import ObjectStore

logger = logging.getLogger(__name__)

# The names other modules import from here: the repository and what its callers hand it.
__all__ = [
    "CheckpointError",
    "CheckpointRepository",
    "Entry",
    "Loaded",
    "Manifest",
    "Payload",
    "StaleCheckpoint",
    "deserialize",
    "serialize",
    "sha256",
    "snapshot",
]

RETAINED_MANIFESTS = 2
"""Everything the newest two valid manifests name stays: a late, unacknowledged publication
(see ``commit``) can hide the acknowledged head from the newest manifest, never from both."""
STALE_RETRY_S = 0.05
"""How long a writer waits before reading again a log its store answered stale."""
GRACE_S = 120.0
"""How old an object no manifest names must be before it is deleted: ample for the clocks of
the nodes and the store to disagree, and for a commit's manifest to follow its upload."""


class CheckpointRepository:
    """Checkpoints of one run in an object store, committed by an append-only manifest log.

    Any number of repositories, in any processes or threads, may commit to one store at once.
    """

    def __init__(
        self,
        store: ObjectStore,
        keep: int = 3,
        prefix: str = "ckpt",
        grace_s: float = GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        fence: Fence | None = None,
    ) -> None:
        """``fence``: the run and round this process's commits carry (default: this worker's,
        read once now: ``Fence.of_process``)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if grace_s <= 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.store = store
        self.keep = keep
        self.prefix = prefix
        self.grace_s = grace_s
        self.clock = clock
        self.writer = uuid.uuid4().hex[:8]
        self.fence = fence if fence is not None else Fence.of_process()
        # Guards only the number below, never a store call: a stalled writer blocks no one.
        self._lock = threading.Lock()
        self._newest_published = -1

    def manifest_name(self, seq: int) -> str:
        return manifest_name(self.prefix, seq)

    def _listed_seqs(self, store: ObjectStore) -> list[int]:
        found = (manifest_seq(n, self.prefix) for n in store.list(f"{self.prefix}-manifest-"))
        return sorted(seq for seq in found if seq is not None)

    def _get_manifest(self, seq: int, store: ObjectStore) -> Manifest | None:
        """Manifest ``seq``; None when it is torn or invalid. FileNotFoundError when absent."""
        manifest = Manifest.decode(store.get(self.manifest_name(seq)))
        if manifest is None or manifest.seq != seq or manifest.foreign(self.prefix):
            logger.warning(
                "manifest %d in %s is torn, misnamed or names invalid entries; ignoring it",
                seq,
                store.describe(),
            )
            return None
        return manifest

    def _log(self, depth: int = 1, store: ObjectStore | None = None) -> tuple[int, list[Manifest]]:
        """(the highest sequence taken, up to ``depth`` valid manifests, newest first).

        Manifests below the newest ``depth`` are read only when those are torn.
        """
        top, found, _ = self._read_log(depth, store or self.store)
        return top, found

    def _read_log(self, depth: int, store: ObjectStore) -> tuple[int, list[Manifest], bool]:
        """``_log``, and whether the view is whole: False when a listed manifest newer than the
        newest valid one read as missing. Pruning never retires those, so the store answered
        from a stale cache (a "not found" remembered from before it was created)."""
        seqs = self._listed_seqs(store)
        top = seqs[-1] if seqs else 0
        # A listing may lag a create that a read already sees: look past its end.
        while True:
            try:
                self._get_manifest(top + 1, store)
            except FileNotFoundError:
                break
            top += 1
            seqs.append(top)
        found: list[Manifest] = []
        whole = True
        for seq in reversed(seqs):
            if len(found) >= depth:
                break
            try:
                manifest = self._get_manifest(seq, store)
            except FileNotFoundError:
                whole = whole and bool(found)  # retired since the listing, if older than one read
                continue
            if manifest is not None:
                found.append(manifest)
        return top, found, whole

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

    def newest_intact(self) -> Entry | None:
        """The newest checkpoint whose objects are in the store at their sizes (``_intact``)."""
        return next((e for e in self.entries() if self._intact(e, self.store)), None)

    def load_latest(self) -> Loaded | None:
        """The newest checkpoint whose checksum verifies, falling back to older ones."""
        for entry in self.entries():
            try:
                data: bytes | None = self.store.get(entry.name)
            except FileNotFoundError:
                data = None
            if data is not None and sha256(data) == entry.sha256:
                return Loaded(entry, data)
            logger.warning("checkpoint %s is missing or torn; trying an older one", entry.name)
        return None

    def read_log(
        self, deadline: Deadline | None = None, store: ObjectStore | None = None
    ) -> LogRead:
        """The log as a commit reads it before its upload: a DCP writer reads it, refuses a stale
        step before it uploads (``stale``), and ``commit`` publishes on it with no second read."""
        store = store or (self.store.bounded(deadline) if deadline else self.store)
        read_at = self.clock()  # before the read: a manifest listed later is younger still
        return LogRead(read_at, *self._read_log(1, store))

    def stale(self, step: int, log: LogRead, newer_only: bool) -> int | None:
        """The committed step in ``log`` that makes ``step`` stale, or None (see ``commit``)."""
        head = next(iter(log.manifests[0].entries), None) if log.manifests else None
        return self._newer_than(Entry("", step, "", 0), head, self.store, newer_only)

    # -- committing ----------------------------------------------------------------------------
    def commit(
        self,
        step: int,
        data: bytes | Payload,
        *,
        deadline: Deadline | None = None,
        prune: bool = True,
        newer_only: bool = False,
        files: tuple[StoredFile, ...] = (),
        name: str | None = None,
        since: float | None = None,
        log: LogRead | None = None,
    ) -> Entry:
        """Check, write, then publish a checkpoint; returns only once it is acknowledged.

        Raises StaleCheckpoint, and acknowledges nothing, when a newer step that verifies is
        already the head (a stalled background save, or the other half of a split rendezvous,
        must not replace it); with ``newer_only`` also when the head is this step or newer as
        its manifest says (another node's agent was first). CheckpointError when publishing
        took so long that a concurrent prune may have removed the object; DeadlineExceeded
        when ``deadline`` passed first (it bounds every store call). ``prune``: prune once
        acknowledged. A sharded checkpoint's ``files`` are in the store already: ``data`` is its
        metadata, written as ``name``, and the grace runs from ``since`` (on this clock).
        ``log``: the manifest log ``read_log`` read, published on without a second read."""
        payload = data if isinstance(data, Payload) else Payload.of(data)
        entry = Entry(name or object_name(self.prefix, step), step, payload.sha256, payload.size)
        entry = Entry.from_json({**entry.to_json(), "files": [vars(f) for f in files]})
        entry = replace(entry, fence=self.fence)
        store = self.store.bounded(deadline) if deadline is not None else self.store
        uploaded, newer = self._publish_entry(
            entry, payload, store, deadline, newer_only, since, log
        )
        if newer is not None:
            older = f"is older than step {newer}," if newer != step else "is"
            raise StaleCheckpoint(
                f"checkpoint of step {step} {older} already committed to "
                f"{self.store.describe()}; dropped"
            )
        assert uploaded is not None  # published
        late = self.clock() - uploaded
        with self._lock:
            self._newest_published = max(self._newest_published, step)
        if late >= self.grace_s / 2:
            raise CheckpointError(
                f"checkpoint of step {step} was published {late:.0f} s after its upload or "
                f"its log read, past half the {self.grace_s:.0f} s grace; not counted as "
                "committed (a concurrent prune may have removed it or its manifest)"
            )
        if prune:
            self.prune()
        return entry

    def _write(self, entry: Entry, payload: Payload, store: ObjectStore) -> float:
        """Write ``entry`` and check the store's receipt; the clock when the write returned.

        The store dates the object no later than that (its modification time), and the
        grace period runs from that date, whatever the size of the upload.
        """
        stored = store.put(entry.name, payload.source)
        uploaded = self.clock()
        if stored != entry.size:
            self._discard(entry, store)
            raise CheckpointError(
                f"checkpoint {entry.name} in {store.describe()} is torn: the store holds "
                f"{stored} of its {entry.size} bytes"
            )
        return uploaded

    def _discard(self, entry: Entry, store: ObjectStore) -> None:
        """Delete objects of ours that no manifest names (best effort: pruning retries)."""
        for name in entry.objects:
            try:
                store.delete(name)
            except OSError as exc:
                logger.warning("could not delete unpublished %s: %s", name, exc)

    def _publish_entry(
        self,
        entry: Entry,
        payload: Payload,
        store: ObjectStore,
        deadline: Deadline | None,
        newer_only: bool,
        since: float | None,
        log: LogRead | None,
    ) -> tuple[float | None, int | None]:
        """Upload ``entry``, publish it on top of the newest manifest: (the earlier of when the
        upload returned and when the log the manifest builds on was read, or None; the step
        that made it stale, or None).

        The log is read once, before the upload (or given: ``log``): on a slow store a commit
        is that read, the upload and the manifest (an eviction's deadline counts round trips).
        Building on it is safe: a manifest published meanwhile took the next number, our
        create-only write fails, and the log is read again, as is a read half the grace old
        (the number it found free may have been taken and retired since). The head never goes
        back, not even with a second group writing; one failing its checksum may."""
        uploaded: float | None = None
        read_at, top, manifests, whole = log or self.read_log(store=store)
        while True:
            base = manifests[0] if manifests else None
            head = base.entries[0] if base and base.entries else None
            if head is not None and entry.fence.older_than(head.fence):
                logger.warning(
                    "checkpoint of step %d refused: it comes from round %d of run %s, the head "
                    "(step %d) from round %d; this group's round is over",
                    entry.step,
                    entry.fence.round,
                    entry.fence.run,
                    head.step,
                    head.fence.round,
                )
                if uploaded is not None or entry.files:
                    self._discard(entry, store)
                raise StaleCheckpoint(
                    f"checkpoint of step {entry.step} from round {entry.fence.round} is older "
                    f"than the head's round {head.fence.round}; dropped"
                )
            newer = self._newer_than(entry, head, store, newer_only)
            if newer is not None:
                if uploaded is not None or entry.files:  # a sharded one's are in already
                    self._discard(entry, store)
                return uploaded, newer
            if uploaded is None:
                # An error after this leaves the object to pruning: a manifest may name it.
                uploaded = self._write(entry, payload, store)
                if since is not None:  # the grace runs from the first file
                    uploaded = min(uploaded, since)
            if self.clock() - uploaded >= self.grace_s / 2:
                self._discard(entry, store)
                raise CheckpointError(
                    f"checkpoint of step {entry.step} could not be published within half the "
                    f"{self.grace_s:.0f} s grace of its upload; dropped"
                )
            if deadline is not None:
                deadline.check(f"publishing the checkpoint of step {entry.step}")
            if not whole or self.clock() - read_at >= self.grace_s / 2:
                if not whole:  # building on an older manifest could move the head back: wait
                    time.sleep(STALE_RETRY_S)
                read_at = self.clock()
                top, manifests, whole = self._read_log(1, store)
                continue
            older = [e for e in base.entries if e.step < entry.step] if base else []
            manifest = Manifest(top + 1, (entry, *older[: self.keep - 1]), self.writer)
            try:
                store.put_new(self.manifest_name(manifest.seq), manifest.encode())
            except FileExistsError:
                logger.info(
                    "manifest %d of %s was taken by another writer; publishing on top of it",
                    manifest.seq,
                    store.describe(),
                )
                read_at = self.clock()
                top, manifests, whole = self._read_log(1, store)
                continue
            return min(uploaded, read_at), None

    def _newer_than(
        self, entry: Entry, head: Entry | None, store: ObjectStore, newer_only: bool
    ) -> int | None:
        """The committed step that makes ``entry`` stale, or None (see ``commit``)."""
        if entry.step < self._newest_published:
            return self._newest_published
        if head is not None and newer_only and head.step >= entry.step:
            return head.step  # as its manifest says
        if head is not None and head.step > entry.step and self._intact(head, store):
            with self._lock:
                self._newest_published = max(self._newest_published, head.step)
            return head.step
        return None

    def _intact(self, entry: Entry, store: ObjectStore) -> bool:
        """Whether ``entry``'s object is in the store at its listed size and a sharded one's files
        are all there: not its checksum (a download); bytes damaged in place fail the readers'."""
        try:
            whole = store.size(entry.name) == entry.size
        except FileNotFoundError:
            return False
        listed = set(store.list(entry.checkpoint_id)) if whole and entry.files else set()
        return whole and all(f.name in listed for f in entry.files)

    def prune(self) -> None:
        """Delete what is provably unreferenced (the module docstring says why that is safe);
        a store error is logged (pruning retries)."""
        try:
            now = self.store.now()
            # Ages are read before the manifests: an object old enough now was old enough when
            # the manifests below were read, so any manifest naming it was visible to that read.
            objects = self.store.list_modified(self.prefix + "-")
            old = {name for name, modified in objects.items() if now - modified > self.grace_s}
            top, manifests = self._log(depth=RETAINED_MANIFESTS)
            for name in unreferenced(old, manifests, top, self.prefix, RETAINED_MANIFESTS):
                self.store.delete(name)
        except (OSError, DeadlineExceeded) as exc:
            logger.warning("pruning %s failed (the next commit retries): %s", self.prefix, exc)
