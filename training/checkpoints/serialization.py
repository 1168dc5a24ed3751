"""A training state as a checkpoint's bytes: serialized in memory, or spooled into a file.

An eviction's save of a large model must fit the notice, so ``spool`` writes the state
straight into a file and hashes it in the same pass; the durable upload then streams that
file. Both skip the CRC-32 torch.save computes for each record of its zip (torch 2.13's
``torch.utils.serialization.config.save.compute_crc32``): the checkpoint's SHA-256 covers every
byte already, and the CRC doubled the time of a 1 GB save here. Loading is ``weights_only``: a
checkpoint on shared storage is data, never code.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.utils.serialization.config as torch_serialization

from training.checkpoints.manifest import CheckpointError, sha256

_crc = {"users": 0, "saved": True}
_crc_lock = threading.Lock()  # held only to flip the flag, never across a save


@contextmanager
def without_crc() -> Iterator[None]:
    """torch.save without its per-record CRC-32 while any of our saves runs (a save on the
    background thread and the eviction's may overlap); the setting is restored after."""
    with _crc_lock:
        if _crc["users"] == 0:
            _crc["saved"] = torch_serialization.save.compute_crc32
            torch_serialization.save.compute_crc32 = False
        _crc["users"] += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc["users"] -= 1
            if _crc["users"] == 0:
                torch_serialization.save.compute_crc32 = _crc["saved"]


def serialize(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    with without_crc():
        torch.save(state, buffer)
    return buffer.getvalue()


def deserialize(data: bytes) -> dict[str, Any]:
    """The state in a checkpoint's bytes; CheckpointError when they are not one.

    The bytes passed their checksum, so they are what some writer wrote; whatever torch.load
    raises on them (another program's file, a format this torch cannot read) is about the
    data, not a bug here.
    """
    try:
        # weights_only: a checkpoint on shared storage is data, never code to unpickle.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"not a checkpoint this program can read: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"not a checkpoint this program can read: a {type(state)}")
    return state


def load_mapped(path: Path) -> dict[str, Any]:
    """The state in the checkpoint file ``path``, its tensors mapped from the file, not read:
    the pages are read as they are used, so a reader that wants only the small entries pays
    for those. A ``MAP_PRIVATE`` mapping (torch's default): writes to the tensors stay in this
    process. Needs the zip format ``torch.save`` writes by default, as ``serialize`` and
    ``spool`` do (torch 2.13's serialization.py: "mmap can only be used with files saved with
    `torch.save(_use_new_zipfile_serialization=True)`"). CheckpointError as ``deserialize``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"not a checkpoint this program can read: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"not a checkpoint this program can read: a {type(state)}")
    return state


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in small pieces: never the whole file in memory."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
class Payload:
    """A checkpoint's bytes, in memory or in a local file, with their size and SHA-256."""

    source: bytes | Path
    size: int
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> Payload:
        return cls(data, len(data), sha256(data))


class HashingWriter:
    """A file that hashes what it writes, hashing on a second thread while the disk writes.

    hashlib and file writes both release the GIL on large buffers, so a large state costs
    about one pass instead of two. torch.save hands over each tensor's storage in one call.
    """

    PARALLEL_BYTES = 1 << 20

    def __init__(self, file: BinaryIO, pool: ThreadPoolExecutor) -> None:
        self.file, self.pool = file, pool
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= self.PARALLEL_BYTES:
            hashed = self.pool.submit(self.hash.update, view)
            self.file.write(view)
            hashed.result()
        else:
            self.hash.update(view)
            self.file.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.file.flush()


def spool(state: dict[str, Any], path: Path) -> Payload:
    """Serialize ``state`` straight into the new file ``path``: no copy of it in memory."""
    with (
        ThreadPoolExecutor(1, thread_name_prefix="hash") as pool,
        open(path, "xb") as f,
        without_crc(),
    ):
        writer = HashingWriter(f, pool)
        torch.save(state, writer)  # type: ignore[arg-type]
        writer.flush()
    return Payload(path, writer.size, writer.hash.hexdigest())
