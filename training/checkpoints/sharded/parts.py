"""Parts: each rank's share of a sharded checkpoint, saved with no collective, and the commit
that joins a whole world's parts into one checkpoint.

An emergency save cannot count on a collective: a peer that left may be why it runs. So each
rank saves its part alone: DCP with ``no_dist`` (torch 2.13 ``state_dict_saver.py``: the plan,
the write and ``finish`` on this rank only) writes its shards, with their offsets in the whole
tensors, and its copy of the replicated values into one file, and a record
(``<id>.<rank>.part``: the file, its size and SHA-256, and DCP's metadata of the part). The
ranks of a round agreed on ``<id>`` when it started, so no message is needed when it ends.

Once every rank of that world wrote its part of a step, the next round's coordinator merges
the records into one checkpoint's metadata (``merge``: the union of the shards' chunks; a
value every part holds is read from the lowest rank's, as a collective save keeps the
coordinator's RNG streams) and commits it like any other (``complete``). Loading it, resharded
at any world size, is ``ShardedCheckpoints.load``: the readers check every file against the
sizes and hashes the records gave. A set with a part missing (a node killed without notice)
is never committed; pruning removes its objects with the other unreferenced ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from training.checkpoints.checkpoint import CheckpointError, Entry, StaleCheckpoint
from training.checkpoints.deadline import Deadline
from training.checkpoints.manifest import (
    StoredFile,
    metadata_name,
    object_step,
    parse_part,
    part_name,
    sha256,
)
from training.checkpoints.node_prune import scratch_folder
from training.checkpoints.serialization import Payload
from training.checkpoints.sharded.metadata import decode, encode
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.writer import SaveOptions, Shard, StoreWriter, Written

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """One rank's part of step ``step``, as its record says."""

    checkpoint_id: str
    step: int
    rank: int
    world: int
    file: StoredFile | None
    """None when the planner gave this rank nothing to write."""
    metadata: Metadata

    def encode(self) -> bytes:
        """A JSON line, then DCP's metadata (read back as data: ``metadata.py``)."""
        body = encode(self.metadata)
        head = {
            "step": self.step,
            "rank": self.rank,
            "world": self.world,
            "file": dataclasses.asdict(self.file) if self.file else None,
            "metadata_sha256": sha256(body),
        }
        return json.dumps(head, sort_keys=True).encode() + b"\n" + body

    @staticmethod
    def decode(data: bytes, name: str, prefix: str) -> Part:
        """The part in ``data`` (the object ``name``); CheckpointError when it is not one."""
        parsed = parse_part(name, prefix)
        head_line, _, body = data.partition(b"\n")
        try:
            head = json.loads(head_line)
            if parsed is None or not isinstance(head, dict):
                raise ValueError("not a part's name, or no JSON object first")
            checkpoint_id, step, rank = parsed
            if (head["step"], head["rank"]) != (step, rank) or not head["world"] > rank >= 0:
                raise ValueError(f"step, rank or world {head} do not fit the name")
            file = StoredFile.from_json(head["file"], checkpoint_id) if head["file"] else None
            if head["metadata_sha256"] != sha256(body):
                raise ValueError("the metadata fails its checksum")
        except (KeyError, TypeError, ValueError) as exc:
            why = f"{name} is not a part's record this program reads: {exc}"
            raise CheckpointError(why) from exc
        return Part(checkpoint_id, step, rank, int(head["world"]), file, decode(body, name))


class PartWriter(StoreWriter):
    """Writes rank ``rank``'s part of checkpoint ``checkpoint_id`` alone; ``part`` after it."""

    def __init__(
        self,
        checkpoints: ShardedCheckpoints,
        checkpoint_id: str,
        step: int,
        rank: int,
        world: int,
        spool: Path,
        deadline: Deadline | None,
    ) -> None:
        super().__init__(checkpoints.repository, step, spool, SaveOptions(deadline=deadline))
        self.part_id, self.rank, self.world = checkpoint_id, rank, world
        self.kept = checkpoints.kept
        self.part: Part | None = None

    def keep(self, name: str, path: Path) -> None:
        """A copy on this node's disk (a hard link of the file uploaded, where it can be):
        the next round's ranks here read it instead of the store. Without one, they read the
        store's: a save never fails for it."""
        if self.kept is None:
            return
        try:
            self.kept.put(name, path)
        except OSError as exc:
            logger.warning("%s is not kept on this node: %s", name, exc)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Alone, by design: no collective, whatever DCP's ``use_collectives`` says."""

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plans[0], storage_data=Shard(self.part_id, self.rank))]

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        """The record, once the file is in the store: a record names only a whole file."""
        storage, files = {}, set()
        for result in results[0]:
            written: Written = result.storage_data
            files.add(written.file)
            storage[result.index] = _StorageInfo(written.file.name, written.offset, written.length)
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        self.part = Part(
            self.part_id, self.step, self.rank, self.world, next(iter(files), None), metadata
        )
        self.store.put(part_name(self.part_id, self.rank), self.part.encode())


def save_part(
    checkpoints: ShardedCheckpoints,
    state_dict: dict[str, Any],
    checkpoint_id: str,
    step: int,
    rank: int,
    world: int,
    deadline: Deadline | None = None,
) -> Part:
    """Save this rank's part of ``state_dict`` (its shards, its copy of what is replicated)
    alone; CheckpointError when its file or record could not be written."""
    drop_kept(checkpoints, before=step)
    with scratch_folder(checkpoints.scratch, ".spool-") as spool:
        writer = PartWriter(checkpoints, checkpoint_id, step, rank, world, spool, deadline)
        try:
            with warnings.catch_warnings():  # DCP warns that no_dist saves "in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(state_dict, storage_writer=writer, no_dist=True)
        except CheckpointException as exc:
            raise CheckpointError(f"part {rank} of step {step}: {exc}") from None
    assert writer.part is not None
    return writer.part


def drop_kept(checkpoints: ShardedCheckpoints, before: int) -> None:
    """Remove this node's copies of parts older than step ``before``: every rank of the
    round loaded what it needed from them (each linked its files before any rank's load
    went on), so at most the newest parts stay on the node."""
    kept, prefix = checkpoints.kept, checkpoints.repository.prefix
    if kept is None:
        return
    try:
        for name in kept.list(prefix + "-"):
            step = object_step(name, prefix)
            if step is not None and step < before:
                kept.delete(name)
    except OSError as exc:  # only disk space: the save goes on
        logger.warning("this node's older parts could not be removed: %s", exc)


def merge(parts: list[Part]) -> Metadata:
    """One checkpoint's metadata from every rank's part: each tensor's chunks from all of
    them, a chunk (or a value) that several hold from the lowest rank's."""
    parts = sorted(parts, key=lambda p: p.rank)
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for part in parts:
        meta = part.metadata
        for fqn, item in meta.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                if fqn not in state:
                    state[fqn] = item
                    storage[MetadataIndex(fqn)] = meta.storage_data[MetadataIndex(fqn)]
                continue
            assert isinstance(item, TensorStorageMetadata)
            merged = state.setdefault(fqn, TensorStorageMetadata(item.properties, item.size, []))
            if merged.size != item.size:
                raise CheckpointError(
                    f"part {part.rank} of step {part.step} holds {fqn} of size "
                    f"{tuple(item.size)}, another part {tuple(merged.size)}"
                )
            held = {tuple(chunk.offsets) for chunk in merged.chunks}
            for chunk in item.chunks:
                if tuple(chunk.offsets) not in held:
                    merged.chunks.append(chunk)
                    index = MetadataIndex(fqn, chunk.offsets)
                    storage[index] = meta.storage_data[index]
    first = parts[0].metadata
    return Metadata(
        state_dict_metadata=state,
        planner_data=first.planner_data,
        storage_data=storage,
        storage_meta=first.storage_meta,
        version=first.version,
    )


def complete(checkpoints: ShardedCheckpoints, newer_than: int) -> Entry | None:
    """Commit the newest step past ``newer_than`` for which every rank of a world saved its
    part; the entry, or None when no such set is whole. Run by one process (a round's
    coordinator): the commit protocol refuses a step older than one already committed."""
    store, prefix = checkpoints.store, checkpoints.repository.prefix
    sets: dict[tuple[int, str], list[str]] = {}
    for name in store.list(prefix + "-"):
        parsed = parse_part(name, prefix)
        if parsed is not None and parsed[1] > newer_than:
            sets.setdefault((parsed[1], parsed[0]), []).append(name)
    for step, checkpoint_id in sorted(sets, reverse=True):
        parts = _whole(checkpoints, sets[step, checkpoint_id])
        if parts is None:
            continue
        files = tuple(sorted({p.file for p in parts if p.file}, key=lambda f: f.name))
        try:
            return checkpoints.repository.commit(
                step,
                Payload.of(encode(merge(parts))),
                newer_only=True,
                files=files,
                name=metadata_name(checkpoint_id),
            )
        except StaleCheckpoint as exc:
            logger.info("the parts of %s are not needed: %s", checkpoint_id, exc)
            return None
    return None


def _whole(checkpoints: ShardedCheckpoints, names: list[str]) -> list[Part] | None:
    """Every rank's part of one set, or None when one is missing or unreadable."""
    prefix = checkpoints.repository.prefix
    parts = []
    for name in names:
        try:
            parts.append(Part.decode(checkpoints.store.get(name), name, prefix))
        except (CheckpointError, FileNotFoundError) as exc:
            logger.warning("part %s cannot be used: %s", name, exc)
            return None
    worlds = {p.world for p in parts}
    if len(worlds) != 1 or {p.rank for p in parts} != set(range(worlds.pop())):
        return None
    return parts


def part_set_id(prefix: str, step: int, round_nonce: str) -> str:
    """The id every rank of a round gives its parts of ``step``: the round's nonce (agreed
    when it started) in the place of a checkpoint's random one."""
    nonce = hashlib.sha256(round_nonce.encode()).hexdigest()[:8]
    return f"{prefix}-{step:010d}-{nonce}"
