"""A node's own copy of a run's state: emergency saves and a progress marker on local disk.

Local rank 0 writes them (an eviction's or a re-form's save), and the next round's restore
(``resume.py``) claims the newest that verifies. Every save prunes the older ones, and a save
still in use is never deleted (``node_prune.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from training.checkpoints.checkpoint import (
    CheckpointError,
    CheckpointRepository,
    Entry,
    Loaded,
    Payload,
    deserialize,
    sha256,
)
from training.checkpoints.node_prune import Pin, Pruner, reading, retire
from training.checkpoints.node_prune import prune as prune_saves
from training.checkpoints.serialization import file_sha256, load_mapped, spool
from training.checkpoints.sharded.state import unpack
from training.checkpoints.storage import FileStore

logger = logging.getLogger(__name__)

NONE = -1
"""No step: nothing saved or recorded."""


@dataclass(frozen=True)
class Held:
    """A verified checkpoint's entry and its state (a node-local one's tensors mapped)."""

    entry: Entry
    state: dict[str, Any]


def uri_digest(checkpoint_uri: str) -> str:
    """A short, stable name for a checkpoint URI (a trailing slash does not change it)."""
    return hashlib.sha256(checkpoint_uri.rstrip("/").encode()).hexdigest()[:12]


def node_local_key(run_id: str, checkpoint_uri: str, lineage: str) -> str:
    """The node-local directory name of one job: its rendezvous id, its checkpoint URI *and*
    the lineage id its durable store holds.

    Plain ``torchrun`` uses the rendezvous id "none" for every job, so the id alone would let
    a new job on this host resume from another job's emergency save. The lineage changes when
    the store is emptied: a run started again under the same id and URI then never resumes a
    node-local step of the history that was deleted.
    """
    safe_id = re.sub(r"[^A-Za-z0-9._-]", "_", run_id) or "run"
    safe_lineage = re.sub(r"[^A-Za-z0-9]", "", lineage)[:12] or "none"
    return f"{safe_id}-{uri_digest(checkpoint_uri)}-{safe_lineage}"


class NodeLocalState:
    """Emergency saves and a progress marker on node-local disk (one writer: local rank 0).

    ``expected_run`` is the run's identity (the state's ``"run"`` entry): a save written by
    another run, or with other settings, is ignored rather than resumed from.
    """

    def __init__(
        self,
        root: str | Path,
        run_id: str,
        expected_run: dict[str, Any] | None = None,
        keep: int = 1,
    ) -> None:
        """``keep``: saves left on the node after each save. One: a full state per node is
        what the disk can spare, and a torn one falls back to the durable store."""
        self.root = Path(root) / run_id
        # No fsync: a copy here must outlive the process, not the node's kernel (a torn
        # object after a crash fails its checksum and is skipped).
        store = FileStore(self.root, fsync=False)
        self.repository = CheckpointRepository(store, keep=keep, prefix="emergency")
        self.keep = keep
        self.expected_run = expected_run
        self._pin: Pin | None = None
        """The save this process still needs (its last save, or the newest it handed out)."""
        # Not ``self.prune``: a cycle through this object would keep its pin until a gc pass.
        self._pruner = Pruner(partial(prune_saves, self.root, self.repository.prefix, keep))
        self._progress_path = self.root / "progress"
        self._progress_fd: int | None = None
        for leftover in self.root.glob(".spool-*"):  # a save cut off by its deadline
            leftover.unlink(missing_ok=True)
        self._pruner.request()  # what an earlier process retired but had no time to delete

    def mark_progress(self, step: int) -> None:
        """Record the last completed step: one small pwrite, cheap enough for every step."""
        if self._progress_fd is None:
            self._progress_fd = os.open(self._progress_path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._progress_fd, f"{step:020d}".encode(), 0)

    def progress(self) -> int:
        try:
            return int(self._progress_path.read_text().strip() or NONE)
        except (FileNotFoundError, ValueError):
            return NONE

    def save(self, step: int, data: bytes) -> None:
        self._commit(step, lambda path: _write_new(path, data))

    def save_state(self, step: int, state: dict[str, Any]) -> Payload:
        """Serialize ``state`` straight to this node's disk and commit it; its bytes, as the
        committed file (for a durable upload that streams it)."""
        return self._commit(step, lambda path: spool(state, path))

    def _commit(self, step: int, write: Callable[[Path], Payload]) -> Payload:
        """Write a save (``write`` fills a new file), commit it, keep it pinned, prune."""
        spooled = self.root / f".spool-{uuid.uuid4().hex[:8]}"
        try:
            payload = write(spooled)
            # The committed object is a hard link to this file: pinned before a prune can
            # list it, it is safe from another writer's prune while unpublished.
            pin = Pin(spooled)
            try:
                entry = self.repository.commit(step, payload, prune=False)
            except BaseException:
                pin.release()
                raise
        finally:
            spooled.unlink(missing_ok=True)
        self._hold(pin)
        # Retired now (renames), deleted on a thread (node_prune.py says why both).
        retire(self.root, self.repository.prefix, self.keep)
        self._pruner.request()
        return Payload(self.root / entry.name, payload.size, payload.sha256)

    def prune(self) -> list[str]:
        """Delete this run's saves past the ``keep`` newest, except any still in use; the
        names deleted."""
        return prune_saves(self.root, self.repository.prefix, self.keep)

    def wait_pruned(self) -> None:
        """Wait until the prunes the saves started have run."""
        self._pruner.wait()

    def _hold(self, pin: Pin | None) -> None:
        if self._pin is not None:
            self._pin.release()
        self._pin = pin

    def close(self) -> None:
        """Release the save this process held on to (its process's end does so too)."""
        self.wait_pruned()
        self._hold(None)

    def newest(self) -> tuple[int, Payload] | None:
        """The step and bytes (as its file) of this run's newest verified save, or None.

        The file stays pinned (no prune deletes it) until this process's next save or
        ``newest``, ``close``, or its end: a durable commit streams it after this returns.
        """
        with reading(self.root):  # no prune between the manifests' read and the save's
            held = self._verified_file(parse=self.expected_run is not None)
            if held is None:
                return None
            self._hold(Pin(self.root / held[0].name))
        entry = held[0]
        return entry.step, Payload(self.root / entry.name, entry.size, entry.sha256)

    def restorable(self) -> Held | None:
        """The verified emergency save of this run with its state, its tensors mapped from the
        file (read as they are used), or None (none, another run's, or unreadable)."""
        with reading(self.root):  # the mapping is made before a prune may unlink the file
            held = self._verified_file(parse=True)
        return Held(*held) if held is not None and held[1] is not None else None

    def _verified_file(self, parse: bool) -> tuple[Entry, dict[str, Any] | None] | None:
        """The newest save whose file matches its checksum (hashed as it is read, never held
        whole), with its state when ``parse``; None when none does or it is not this run's."""
        for entry in self.repository.entries():
            try:
                intact = file_sha256(self.root / entry.name) == entry.sha256
            except FileNotFoundError:
                intact = False
            if not intact:
                logger.warning(
                    "emergency save %s is missing or torn; trying the one before", entry.name
                )
                continue
            if not parse:
                return entry, None
            try:
                state: dict[str, Any] | None = load_mapped(self.root / entry.name)
                found = _run_of(state)
            except CheckpointError as exc:  # verified bytes, but not a state this program reads
                state, found = None, f"unreadable ({exc})"
            return (entry, state) if self._is_ours(entry, state, found) else None
        return None

    def load(self) -> Loaded | None:
        """The verified emergency save of this run, read into memory, or None (none, or
        another run's)."""
        with reading(self.root):  # no prune between the manifests' read and the save's
            loaded = self.repository.load_latest()
        if loaded is None or self.expected_run is None:
            return loaded
        try:
            state: dict[str, Any] | None = deserialize(loaded.data)
            found = _run_of(state)
        except CheckpointError as exc:  # verified bytes, but not a state this program can read
            state, found = None, f"unreadable ({exc})"
        ours = self._is_ours(loaded.entry, state, found)
        return Loaded(loaded.entry, loaded.data, state) if ours else None

    def _is_ours(self, entry: Entry, state: dict[str, Any] | None, found: Any) -> bool:
        if state is not None and (self.expected_run is None or found == self.expected_run):
            return True
        logger.warning(
            "ignoring the emergency save of step %d in %s: written by run %s, this run is %s",
            entry.step,
            self.root,
            found,
            self.expected_run,
        )
        return False


def _write_new(path: Path, data: bytes) -> Payload:
    with open(path, "xb") as f:
        f.write(data)
    return Payload(path, len(data), sha256(data))


def _run_of(state: Any) -> Any:
    """The run identity a save holds (packed, as DCP keeps it: ``sharded/state.py``)."""
    run = state.get("run") if isinstance(state, dict) else None
    if not isinstance(run, bytes):
        return run
    try:
        return unpack(run)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as exc:  # torch.load's refusals
        return f"unreadable ({exc})"
