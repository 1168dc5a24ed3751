"""A DCP ``StorageWriter`` on an object store: each rank streams its own file, the coordinator
commits them all at once.

DCP calls (torch 2.13 ``storage.py``, ``StorageWriter``): ``set_up_storage_writer`` and
``prepare_local_plan`` on every rank, ``prepare_global_plan`` on the coordinator (here it names
the checkpoint, so every rank writes under one id without another collective), ``write_data``
on every rank, then ``finish`` on the coordinator, only once every rank's ``write_data``
returned (``_DistWrapper.all_reduce`` raises on every rank when one failed).

``write_data`` writes the rank's items, one tensor at a time, into a file on local disk (the
spool), hashing in the same pass, and ``put``s the file: Blob streams it in blocks, a directory
on the same filesystem hard-links it. The store's receipt (the size it holds) must match.
``finish`` writes the metadata and publishes a manifest that lists every file with its size
and SHA-256 (``CheckpointRepository.commit``): a checkpoint whose metadata or any file failed
is never committed. The file format is DCP's own (``FileSystemWriter``'s ``torch_save``
items), so the objects, downloaded into one directory with the metadata as ``.metadata``, load
with torch's ``FileSystemReader`` too.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from training.checkpoints.checkpoint import CheckpointError, CheckpointRepository, Entry
from training.checkpoints.deadline import Deadline
from training.checkpoints.manifest import (
    LogRead,
    StoredFile,
    metadata_name,
    shard_name,
    sharded_id,
)
from training.checkpoints.serialization import HashingWriter, Payload, without_crc
from training.checkpoints.sharded.metadata import encode


@dataclass(frozen=True)
class Shard:
    """What the coordinator's plan tells a rank: the checkpoint's id and the rank's place."""

    checkpoint_id: str
    rank: int


@dataclass(frozen=True)
class Written:
    """Where one item landed, and the file it is in (the coordinator lists the files)."""

    offset: int
    length: int
    file: StoredFile


@dataclass(frozen=True)
class SaveOptions:
    """How a save is committed (``CheckpointRepository.commit``'s options)."""

    deadline: Deadline | None = None
    prune: bool = True
    newer_only: bool = False
    alone: bool = False
    """One process writes the whole checkpoint and commits it (DCP's ``no_dist``): a DDP
    node's save of its replica, whose every rank holds the same state."""
    log: LogRead | None = None
    """The manifest log read before the upload, which the commit publishes on."""


class StoreWriter(StorageWriter):
    """Writes one sharded checkpoint of ``step`` into ``repository``'s store; after a save the
    coordinator's ``entry`` is what the manifest committed."""

    def __init__(
        self,
        repository: CheckpointRepository,
        step: int,
        spool: Path,
        options: SaveOptions | None = None,
    ) -> None:
        super().__init__()
        self.repository, self.step, self.spool = repository, step, spool
        self.options = options or SaveOptions()
        self.store = repository.store
        if self.options.deadline is not None:
            self.store = self.store.bounded(self.options.deadline)
        self.checkpoint_id: str | None = None
        self.entry: Entry | None = None
        self._since: float | None = None
        self._save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.checkpoint_id, self.entry, self._save_id = None, None, uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True) and not self.options.alone:
            raise CheckpointError("a sharded checkpoint is committed by its coordinator")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.spool.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Before any rank writes: the grace of the commit protocol runs from here.
        self._since = self.repository.clock()
        checkpoint_id = sharded_id(self.repository.prefix, self.step)
        return [
            dataclasses.replace(plan, storage_data=Shard(checkpoint_id, rank))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        shard: Shard = plan.storage_data
        self.checkpoint_id = shard.checkpoint_id
        results: list[WriteResult] = []
        if plan.items:  # a rank the planner gave nothing (replicated state) writes no file
            name = shard_name(shard.checkpoint_id, shard.rank, 0)
            results = self._write_file(name, plan, planner)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        path = self.spool / name
        placed: list[tuple[MetadataIndex, int, int]] = []
        try:
            with (
                ThreadPoolExecutor(1, thread_name_prefix="hash") as pool,
                open(path, "xb") as f,
                without_crc(),  # the file's SHA-256 covers it: a zip CRC-32 halved the rate
            ):
                sink = HashingWriter(f, pool)
                for item in plan.items:
                    offset = sink.size
                    _write_item(sink, planner.resolve_data(item), item.type)
                    placed.append((item.index, offset, sink.size - offset))
                sink.flush()
            stored = self.store.put(name, path)
            if stored == sink.size:
                self.keep(name, path)
        finally:
            path.unlink(missing_ok=True)  # the store holds it (a hard link, or a copy)
        if stored != sink.size:
            raise CheckpointError(
                f"{name} in {self.store.describe()} is torn: the store holds {stored} of its "
                f"{sink.size} bytes"
            )
        file = StoredFile(name, sink.size, sink.hash.hexdigest())
        return [
            WriteResult(index, length, Written(offset, length, file))
            for index, offset, length in placed
        ]

    def keep(self, name: str, path: Path) -> None:
        """The file ``path`` is in the store as ``name``: a collective save keeps no copy."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write the metadata and commit the checkpoint (the coordinator only)."""
        assert self.checkpoint_id is not None and self._since is not None  # planned here
        files: dict[str, StoredFile] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for result in (r for rank in results for r in rank):
            written: Written = result.storage_data
            files[written.file.name] = written.file
            storage[result.index] = _StorageInfo(written.file.name, written.offset, written.length)
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        self.entry = self.repository.commit(
            self.step,
            Payload.of(encode(metadata)),
            deadline=self.options.deadline,
            prune=self.options.prune,
            newer_only=self.options.newer_only,
            log=self.options.log,
            files=tuple(sorted(files.values(), key=lambda f: f.name)),
            name=metadata_name(self.checkpoint_id),
            since=self._grace_start(files),
        )

    def _grace_start(self, files: dict[str, StoredFile]) -> float:
        """When the grace of this checkpoint began, on the repository's clock: when its oldest
        file reached the store. Pruning counts an object's age from its own last write
        (``list_modified``, against the store's ``now``), so a save whose ranks wrote for
        minutes is safe while each file is young; counting from the plan would refuse every
        save that takes longer than half the grace (a GB-scale state on a slow link)."""
        assert self.checkpoint_id is not None and self._since is not None
        modified = self.store.list_modified(self.checkpoint_id)
        written = [modified[name] for name in files if name in modified]
        if len(written) < len(files):  # one is gone already: the plan's time, the strict one
            return self._since
        age = max(self.store.now() - min(written), 0.0)
        return max(self.repository.clock() - age, self._since)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # chosen explicitly, never inferred from a path


def _write_item(sink: HashingWriter, data: Any, kind: WriteItemType) -> None:
    """One item as DCP's ``torch_save`` format holds it: bytes as they are, a tensor as one
    ``torch.save`` of its own (a CPU copy of this tensor alone, and of its elements only)."""
    if kind == WriteItemType.BYTE_IO:
        assert isinstance(data, io.BytesIO)
        sink.write(data.getbuffer())
        return
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # a view would save its whole storage
    torch.save(tensor, sink)  # type: ignore[arg-type]
