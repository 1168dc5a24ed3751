"""A DCP ``StorageReader`` on an object store that verifies every file before it loads.

DCP calls (torch 2.13 ``state_dict_loader.py``, ``_load_state_dict``): ``read_metadata``, then
``set_up_storage_reader`` and ``prepare_local_plan`` on every rank, gathered by the coordinator
(``_DistWrapper.reduce_scatter``: one rank's exception fails the step on every rank), then
``read_data``. So the checks run before any tensor is written:

- ``read_metadata`` reads the metadata object, checks its SHA-256 against the manifest's entry
  and reads it as data (``metadata.py``);
- ``prepare_local_plan`` brings each file this rank's plan reads into a local directory
  (streamed from Blob, hashing as it downloads; hard-linked from a directory on the same
  filesystem, then hashed in place) and compares size and SHA-256 with the manifest. A file
  that is missing, torn or not listed fails the load on every rank, naming the file. A file
  this node kept when its ranks saved their parts is linked from the node's disk first, and
  checked the same way; the store serves it when that copy is torn or gone.

``read_data`` is torch's ``FileSystemReader`` on that directory (one tensor at a time). Values
that are not tensors go through ``VerifiedLoadPlanner``, which unpickles them with
``weights_only`` (DCP's default planner does not).
"""

from __future__ import annotations

import io
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from hashlib import file_digest
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from training.checkpoints.manifest import CheckpointError, Entry, StoredFile, sha256
from training.checkpoints.serialization import HashingWriter
from training.checkpoints.sharded.metadata import decode
from training.checkpoints.storage import FileStore, ObjectStore

logger = logging.getLogger(__name__)

MISSING = "is missing"
"""What ``fetch_verified`` says of a file that is not there."""


class StoreReader(FileSystemReader):
    """Reads the sharded checkpoint ``entry`` of ``store`` through its files in ``cache``."""

    def __init__(
        self, store: ObjectStore, entry: Entry, cache: Path, kept: ObjectStore | None = None
    ) -> None:
        """``kept``: the files this node's ranks wrote for their parts (``parts.py``), read
        from there before the store."""
        super().__init__(cache)
        self.store, self.entry, self.cache, self.kept = store, entry, cache, kept
        self._files = {f.name: f for f in entry.files}
        self.store_error: OSError | None = None
        """The store's own failure (an outage, a denial), which says nothing of the checkpoint:
        DCP reports it only as text."""

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        """No ``rank`` keyword: DCP then never looks for per-rank metadata, which we never
        write."""
        name = self.entry.name
        try:
            data = self.store.get(name)
        except FileNotFoundError as exc:
            raise self._failed(name, MISSING) from exc
        except OSError as exc:
            self.store_error = exc
            raise
        if len(data) != self.entry.size or sha256(data) != self.entry.sha256:
            raise self._failed(name, f"fails its checksum ({len(data)} bytes)")
        metadata = decode(data, name)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        needed = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
        self.cache.mkdir(parents=True, exist_ok=True)
        for name in needed:
            listed = self._files.get(name)
            if listed is None:
                raise self._failed(name, "is not listed in the manifest")
            self._fetch(listed)
        return plan

    def _fetch(self, listed: StoredFile) -> None:
        try:
            problem = fetch(self.store, listed, self.cache / listed.name, self.kept)
        except OSError as exc:
            self.store_error = exc
            raise
        if problem is not None:
            raise self._failed(listed.name, problem)

    def _failed(self, name: str, what: str) -> CheckpointError:
        message = (
            f"file {name} of the checkpoint of step {self.entry.step} in "
            f"{self.store.describe()} {what}"
        )
        logger.warning("%s", message)
        return CheckpointError(message)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # chosen explicitly, never inferred from a path


def fetch(
    store: ObjectStore, listed: StoredFile, path: Path, kept: ObjectStore | None = None
) -> str | None:
    """``fetch_verified`` from ``kept`` (this node's copies of its parts' files) when it holds
    the file whole, else from ``store``: a rank on a node that stays reads its own part, or a
    sibling's, from the node's disk instead of downloading what it uploaded."""
    if kept is not None:
        try:
            problem = fetch_verified(kept, listed, path)
        except OSError as exc:  # the node's disk: the store still has the file
            problem = str(exc)
        if problem is None:
            logger.info("read %s from this node's copy", listed.name)
            return None
        if problem != MISSING:
            logger.warning("this node's copy of %s %s; reading the store's", listed.name, problem)
    return fetch_verified(store, listed, path)


def fetch_verified(store: ObjectStore, listed: StoredFile | Entry, path: Path) -> str | None:
    """The object ``listed`` names at ``path``, its size and SHA-256 checked: None when it is
    whole, else what is wrong with it (``path`` is then removed). Other errors of the store
    (an outage) are raised: they say nothing about the checkpoint.

    A directory on this filesystem links the object and hashes it in place: a rank's share of
    a large state is read once instead of read, written and read again. Any other store
    streams it into ``path``, hashing on the way."""
    try:
        if isinstance(store, FileStore) and store.link_into(listed.name, path):
            with open(path, "rb") as f:
                size, digest = os.fstat(f.fileno()).st_size, file_digest(f, "sha256").hexdigest()
        else:
            size, digest = _stream_into(store, listed.name, path)
    except FileNotFoundError:
        path.unlink(missing_ok=True)
        return MISSING
    except OSError:
        path.unlink(missing_ok=True)
        raise
    if size == listed.size and digest == listed.sha256:
        return None
    path.unlink(missing_ok=True)
    return (
        f"is torn: {size} bytes with SHA-256 {digest[:12]}…, the manifest lists "
        f"{listed.size} bytes with {listed.sha256[:12]}…"
    )


def _stream_into(store: ObjectStore, name: str, path: Path) -> tuple[int, str]:
    with ThreadPoolExecutor(1, thread_name_prefix="hash") as pool, open(path, "wb") as f:
        sink = HashingWriter(f, pool)
        store.get_into(name, sink)  # type: ignore[arg-type]
        sink.flush()
    return sink.size, sink.hash.hexdigest()


class VerifiedLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but values that are not tensors are read as data
    (``torch.load(weights_only=True)``), never as code."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, map_location="cpu", weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
