"""Sharded checkpoints of one run: save with every rank, load the newest that verifies.

The commit protocol is ``CheckpointRepository``'s (sequence numbers, create-if-absent
manifests, the grace and lateness rules, pruning): a sharded checkpoint is one entry whose
object is the DCP metadata and which lists the ranks' files. Pruning and ``keep`` thus count
whole checkpoints, and remove every file of one they drop.

Loading takes the entries the coordinator read (every rank tries the same checkpoints in the
same order, even if one rank's store answered from a stale cache), and falls back entry by
entry: a file missing or torn on any rank fails that checkpoint on every rank before any tensor
is written (``reader.py``), and the log names the file.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from training.checkpoints.checkpoint import (
    GRACE_S,
    CheckpointError,
    CheckpointRepository,
    Entry,
    StaleCheckpoint,
)
from training.checkpoints.node_prune import scratch_folder
from training.checkpoints.sharded.reader import StoreReader, VerifiedLoadPlanner, fetch_verified
from training.checkpoints.sharded.state import CoordinatorSavePlanner, ModelState
from training.checkpoints.sharded.writer import SaveOptions, StoreWriter
from training.checkpoints.storage import ObjectStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREFIX = "dcp"
"""Sharded checkpoints' objects: apart from the single-file ones (``ckpt``) in one store."""


class DoesNotFitState(CheckpointError):
    """A checkpoint whose files verify but whose names or shapes are not this state's (another
    model): every older one would fail alike, so no fallback."""

    def __init__(self, entry: Entry, where: str, detail: str) -> None:
        super().__init__(
            f"checkpoint of step {entry.step} in {where} does not fit this state: {detail}"
        )
        self.entry, self.detail = entry, detail


class ShardedCheckpoints:
    """Sharded checkpoints in ``store``; ``scratch`` is local disk for each rank's file on its
    way up and the files a load reads on their way down (removed after each)."""

    def __init__(
        self,
        store: ObjectStore,
        scratch: Path,
        keep: int = 3,
        prefix: str = PREFIX,
        grace_s: float = GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        kept: ObjectStore | None = None,
    ) -> None:
        """``kept``: a directory on this node's disk where its ranks' parts stay after their
        upload (``parts.py``), for the next round's load to read before the store."""
        self.repository = CheckpointRepository(store, keep, prefix, grace_s, clock)
        self.store = store
        self.scratch = scratch
        self.kept = kept

    def save(
        self,
        state_dict: dict[str, Any],
        step: int,
        *,
        group: Any = None,
        options: SaveOptions | None = None,
    ) -> Entry | None:
        """Every rank of ``group`` calls this with its part of the state; returns the committed
        entry on the coordinator (rank 0 of ``group``), None on the others.

        Raises StaleCheckpoint when a newer step is committed already, CheckpointError when any
        rank's file, the metadata or the manifest could not be written: then nothing is
        committed, on every rank alike."""
        with scratch_folder(self.scratch, ".spool-") as spool:
            writer = StoreWriter(self.repository, step, spool, options)
            try:
                planner = CoordinatorSavePlanner()
                dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group)
            except CheckpointException as exc:
                stale = _failures(exc, StaleCheckpoint)
                if stale:
                    raise StaleCheckpoint(stale[0]) from None
                raise CheckpointError(f"checkpoint of step {step}: {_summary(exc)}") from None
        return writer.entry

    def save_alone(
        self, state_dict: dict[str, Any], step: int, options: SaveOptions | None = None
    ) -> Entry:
        """This process writes the whole of ``state_dict`` and commits it, with no collective
        (a DDP node's replica: the state every rank holds). Raises as ``save``; a step that
        cannot become the head (older than it; with ``newer_only``, not newer) before anything
        is uploaded, with one read of the manifest log in all."""
        alone = dataclasses.replace(options or SaveOptions(), alone=True)
        log = self.repository.read_log(alone.deadline)  # the commit publishes on this read
        newer = self.repository.stale(step, log, alone.newer_only)
        if newer is not None:
            raise StaleCheckpoint(
                f"checkpoint of step {step}: step {newer} is already committed to "
                f"{self.store.describe()}; dropped"
            )
        alone = dataclasses.replace(alone, log=log)
        with scratch_folder(self.scratch, ".spool-") as spool:
            writer = StoreWriter(self.repository, step, spool, alone)
            try:
                with warnings.catch_warnings():  # DCP warns no_dist saves "in a single process"
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.save(state_dict, storage_writer=writer, no_dist=True)
            except CheckpointException as exc:
                errors = [error for error, _ in exc.failures.values()]
                # As a single-file commit raised them: the store's errors as they are (a retry
                # may fix a timeout or a 5xx), and anything else is a bug, not the store.
                first = next((e for e in errors if not isinstance(e, CheckpointError)), None)
                if first is not None:
                    raise first from None
                stale = _failures(exc, StaleCheckpoint)
                if stale:
                    raise StaleCheckpoint(stale[0]) from None
                raise CheckpointError(f"checkpoint of step {step}: {_summary(exc)}") from None
        assert writer.entry is not None
        return writer.entry

    def load(
        self, state_dict: dict[str, Any], *, group: Any = None, alone: bool = False
    ) -> Entry | None:
        """Load the newest checkpoint that verifies into ``state_dict`` (every rank of ``group``
        calls this; ``alone``: this process only, with no collective); its entry, or None when
        none does (``state_dict`` is then untouched). A ``ModelState`` in it is told first
        which names (DCP's flattened keys) the checkpoint holds: whether its optimizer's state
        is there to load."""
        models = {k: v for k, v in state_dict.items() if isinstance(v, ModelState)}
        for entry in self.entries() if alone else self._entries(group):
            if models:
                names = self._names(entry, group, alone)
                if names is None:
                    continue
                for key, model in models.items():
                    model.fit(names, key)
            try:
                with scratch_folder(self.scratch, ".load-") as cache, warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # no_dist: "a single process"
                    reader = StoreReader(self.store, entry, cache, self.kept)
                    dcp.load(
                        state_dict,
                        storage_reader=reader,
                        planner=VerifiedLoadPlanner(),
                        process_group=group,
                        no_dist=alone,
                    )
                return entry
            except CheckpointException as exc:
                if alone and reader.store_error is not None:
                    raise reader.store_error from None  # the store, not this checkpoint
                if not _unverified(exc):  # the files verified: they do not fit this state
                    raise DoesNotFitState(entry, self.store.describe(), _summary(exc)) from None
                logger.warning(
                    "checkpoint of step %d (%s) cannot be loaded: %s; trying the previous one",
                    entry.step,
                    entry.name,
                    _summary(exc),
                )
            finally:
                for model in models.values():  # a later save asks the optimizer again
                    model.fit(None, "")
        return None

    def read_whole(
        self, under: str | tuple[str, ...], values: bool = False
    ) -> tuple[Entry, dict[str, Any]] | None:
        """The tensors whose names start with ``under`` (DCP's flattened names, e.g.
        ``model.model.``) of the newest checkpoint that verifies, whole, on the CPU, in this
        process alone: for a comparison or an export, never for training (it holds them all).
        ``values``: the other values under ``under`` too (the step, a packed identity)."""
        for entry in self.entries():
            try:
                return entry, self.read_entry(entry, under, values)
            except (CheckpointError, CheckpointException) as exc:
                logger.warning("checkpoint of step %d cannot be read: %s", entry.step, exc)
        return None

    def read_entry(
        self, entry: Entry, under: str | tuple[str, ...], values: bool = False
    ) -> dict[str, Any]:
        """``read_whole`` of one checkpoint; raises when it does not verify. With ``values`` and
        names of small values alone (the identity), it reads only the files that hold them."""
        with scratch_folder(self.scratch, ".load-") as cache:
            metadata = StoreReader(self.store, entry, cache).read_metadata()
            whole: dict[str, Any] = {
                name: torch.empty(item.size, dtype=item.properties.dtype)
                if isinstance(item, TensorStorageMetadata)
                else None
                for name, item in metadata.state_dict_metadata.items()
                if name.startswith(under) and (values or isinstance(item, TensorStorageMetadata))
            }
            reader = StoreReader(self.store, entry, cache)
            with warnings.catch_warnings():  # DCP warns it loads "in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(whole, storage_reader=reader, planner=VerifiedLoadPlanner(), no_dist=True)
        return whole

    def head(self) -> Entry | None:
        """The newest checkpoint as the manifest claims it (reads nothing but the manifests)."""
        return self.repository.head()

    def newest_verified(self) -> Entry | None:
        """The newest checkpoint whose metadata and every file match the manifest's sizes and
        SHA-256, each fetched to scratch and hashed there, then removed: a check, no load."""
        for entry in self.entries():
            with scratch_folder(self.scratch, ".load-") as cache:
                try:
                    StoreReader(self.store, entry, cache).read_metadata()
                except CheckpointError:
                    continue
                problems = (fetch_verified(self.store, f, cache / f.name) for f in entry.files)
                if all(problem is None for problem in problems):
                    return entry
        return None

    def entries(self) -> list[Entry]:
        """Every checkpoint the retained manifests name, newest first (this rank's read)."""
        return [e for e in self.repository.entries() if e.files]

    def prune(self) -> None:
        self.repository.prune()

    def _entries(self, group: Any) -> list[Entry]:
        """The coordinator's ``entries``, on every rank."""
        return coordinator_decides(self.entries, group)

    def _names(self, entry: Entry, group: Any, alone: bool = False) -> frozenset[str] | None:
        """The names ``entry``'s metadata holds, as the coordinator read them, on every rank
        (``alone``: as this process reads them); None on every rank when it could not (the
        previous checkpoint is tried)."""

        def read() -> frozenset[str]:
            metadata = StoreReader(self.store, entry, self.scratch).read_metadata()
            return frozenset(metadata.state_dict_metadata)

        try:
            return coordinator_decides(read, group, alone)
        except CheckpointError as exc:
            logger.warning("checkpoint of step %d cannot be loaded: %s", entry.step, exc)
            return None


class _Failed(str):
    """What the coordinator could not read, sent in place of what it read."""


def coordinator_decides(read: Callable[[], T], group: Any, alone: bool = False) -> T:
    """``read()`` on the coordinator (rank 0 of ``group``), its answer on every rank, so that
    every rank takes the same path. When the coordinator's storage fails, CheckpointError on
    every rank: the others would otherwise wait out the group's timeout in the broadcast.
    Without a process group (or ``alone``), ``read()`` here, its storage errors as
    CheckpointError too."""
    found: list[Any] = [None]
    if alone or not (dist.is_available() and dist.is_initialized()):
        found = [_coordinator_read(read)]
    else:
        if dist.get_rank(group) == 0:
            found = [_coordinator_read(read)]
        dist.broadcast_object_list(found, src=global_rank(group, 0), group=group)
    if isinstance(found[0], _Failed):
        raise CheckpointError(str(found[0]))
    return found[0]


def _coordinator_read(read: Callable[[], Any]) -> Any:
    """``read()``, or its storage error as a ``_Failed`` to broadcast."""
    try:
        return read()
    except (OSError, CheckpointError) as exc:
        return _Failed(f"the coordinator cannot read the checkpoint store: {exc}")


def global_rank(group: Any, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _failures(exc: CheckpointException, kind: type[BaseException]) -> list[str]:
    """The messages of the ranks' errors of ``kind`` inside DCP's exception."""
    return [str(error) for error, _ in exc.failures.values() if isinstance(error, kind)]


_METADATA_FAILED = "metadata is None"
"""How DCP words a ``read_metadata`` that raised (torch 2.13 ``state_dict_loader.py``)."""


def _unverified(exc: CheckpointException) -> bool:
    """Whether every rank failed on a file that is missing, torn or unreadable (``reader.py``):
    then an older checkpoint may serve. Anything else (a key or a shape this state does not
    have) fails every checkpoint alike."""
    return all(
        isinstance(error, CheckpointError) or str(error).startswith(_METADATA_FAILED)
        for error, _ in exc.failures.values()
    )


def _summary(exc: CheckpointException) -> str:
    """Each failed rank's error in one line (DCP's own text carries whole tracebacks)."""
    return "; ".join(
        f"rank {rank}: {type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"
        for rank, (error, _) in sorted(exc.failures.items())
    )
