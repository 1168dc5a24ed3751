"""Elastic state: what a worker keeps on its node, and how the ranks agree where to resume.

On every (re)start each rank reports the newest state it can reach: its node's emergency save
(node-local disk, already verified) and the durable checkpoint the manifest names. The ranks
all-gather those claims, the holder of the newest one loads and verifies it, and sends it to the
others tensor by tensor (``state_transfer.py``): no rank holds the state serialized, and a
node-local save is mapped from its file, not read into memory. Every rank thus restores the
same state, even if one node read a stale cached manifest.

The agreement reads storage while the other ranks wait in a collective, so it runs on a
process group of its own whose timeout allows a slow store (``--restore-timeout-s``), not on
the default group, whose short timeout exists to detect a frozen peer during training.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

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
from training.checkpoints.sharded.repository import global_rank
from training.checkpoints.state_transfer import share
from training.checkpoints.storage import FileStore

logger = logging.getLogger(__name__)

NONE = -1
T = TypeVar("T")


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
                found = state.get("run")  # type: ignore[union-attr]
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
            found = state.get("run")  # type: ignore[union-attr]
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


@dataclass(frozen=True)
class Resume:
    """Where this round starts."""

    state: dict[str, Any] | None
    step: int
    source: str
    """"fresh", "local" (a node's emergency save) or "durable"."""
    from_rank: int
    lost_steps: int | None
    """Progress any rank had recorded minus the resumed step; None when nothing was recorded."""
    seconds: float


# The holder's answer after it tried to materialise the winning claim.
_OK = 0
"""The state follows (``state_transfer.share``)."""
_LOWERED = 1
"""The durable checkpoint did not verify; every rank lowers that claim to the header's value."""
_UNREADABLE = 2
"""The holder cannot read the durable store; only the holder drops its durable claim."""


def _read(what: str, read: Callable[[], T]) -> tuple[T | None, bool]:
    """(result, failed): a storage error makes this rank claim nothing instead of crashing."""
    try:
        return read(), False
    except (OSError, CheckpointError) as exc:
        logger.warning("cannot read the %s, so this rank claims none from it: %s", what, exc)
        return None, True


class _Claims:
    """This rank's candidates: a verified local save and the durable head (claimed, then loaded)."""

    def __init__(self, local: NodeLocalState | None, durable: CheckpointRepository | None) -> None:
        self.local: Held | None = None
        if local is not None:
            self.local, _ = _read("node-local emergency save", local.restorable)
        self.durable = durable
        head, self.durable_failed = (None, False)
        if durable is not None:
            head, self.durable_failed = _read("durable checkpoint manifest", durable.head)
        self.durable_step = head.step if head else NONE
        self.durable_loaded: Held | None = None

    def row(self, progress: int) -> list[int]:
        local_step = self.local.entry.step if self.local else NONE
        return [local_step, self.durable_step, progress, int(self.durable_failed)]

    def materialize(self, source: str, step: int) -> tuple[int, int, Held | None]:
        """(outcome, value, state) for the winning claim, which this rank holds."""
        if source == "local":
            assert self.local is not None
            return _OK, 0, self.local
        if self.durable_loaded is None or self.durable_loaded.entry.step != step:
            assert self.durable is not None
            self.durable_loaded, failed = _read("durable checkpoint", self._load_durable)
            if failed:
                return _UNREADABLE, NONE, None
        held = self.durable_loaded
        if held is not None and held.entry.step == step:
            return _OK, 0, held
        return _LOWERED, held.entry.step if held else NONE, None

    def _load_durable(self) -> Held | None:
        """The newest durable checkpoint that verifies and parses; its bytes are dropped once
        parsed, so the state is held once."""
        assert self.durable is not None
        loaded = self.durable.load_latest(parse=True)
        return Held(loaded.entry, loaded.state) if loaded and loaded.state is not None else None

    def settle(self, outcome: int, value: int, step: int, holder: bool) -> None:
        """Apply a failed materialisation, so the next round agrees on what can be read."""
        if outcome == _UNREADABLE and holder:
            self.durable_step, self.durable_failed = NONE, True
        elif outcome == _LOWERED and (holder or self.durable_step == step):
            # The same manifest names the same object for every rank: all lower at once,
            # rather than each holder in turn downloading and rejecting it.
            self.durable_step = value


def _pick(rows: torch.Tensor) -> tuple[int, str, int]:
    """(step, source, rank) of the newest claim; local beats durable (no storage read)."""
    best = int(rows[:, :2].max())
    for column, source in ((0, "local"), (1, "durable")):
        holders = (rows[:, column] == best).nonzero()
        if len(holders):
            return best, source, int(holders[0])
    raise AssertionError("unreachable")


def _gather(row: list[int], device: torch.device, group: Any) -> torch.Tensor:
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).cpu()


def _nothing_to_resume(rows: torch.Tensor, known: int, started: float) -> Resume:
    failed = (rows[:, 3] != 0).nonzero().flatten().tolist()
    if failed:
        # Starting fresh would train from step 0 over a run the store may still hold.
        raise CheckpointError(
            f"no rank could read the durable checkpoints (ranks {failed} failed) and none has "
            "an emergency save; refusing to start from step 0 (check --checkpoint-uri)"
        )
    lost = known if known != NONE else None
    return Resume(None, 0, "fresh", NONE, lost, time.monotonic() - started)


def agree_on_resume(
    rank: int,
    device: torch.device,
    local: NodeLocalState | None,
    durable: CheckpointRepository | None,
    group: Any = None,
) -> Resume:
    """All ranks of ``group`` (default: the world) call this together; they return the same state.

    ``rank`` is this process's rank in ``group``; ``device`` holds the collectives' tensors
    (the CPU for a gloo group, even when the default group is NCCL).
    """
    started = time.monotonic()
    claims = _Claims(local, durable)
    progress = local.progress() if local else NONE
    while True:
        rows = _gather(claims.row(progress), device, group)
        known = int(rows[:, 2].max())
        if int(rows[:, :2].max()) == NONE:
            return _nothing_to_resume(rows, known, started)
        step, source, holder = _pick(rows)
        outcome, value, held = (
            claims.materialize(source, step) if rank == holder else (_OK, 0, None)
        )
        header = torch.tensor([outcome, value], dtype=torch.int64, device=device)
        dist.broadcast(header, src=global_rank(group, holder), group=group)
        outcome, value = int(header[0]), int(header[1])
        if outcome != _OK:
            claims.settle(outcome, value, step, rank == holder)
            continue
        # The holder parsed the checkpoint (one that verifies but cannot be read was passed
        # over there), so the others receive exactly the state the holder could read.
        state = share(held.state if held else None, global_rank(group, holder), device, group)
        lost = max(known - step, 0) if known != NONE else None
        return Resume(state, step, source, holder, lost, time.monotonic() - started)
