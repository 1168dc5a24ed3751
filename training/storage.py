"""Where checkpoints live: a tiny object-store interface over a directory or Azure Blob.

The checkpoint protocol (``training/checkpoint.py``) needs only whole-object put/get,
delete and list, and never renames: on blobfuse2 a rename is a copy then a delete, and on
Blob Storage one PutBlob replaces an object atomically.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class ObjectStore(Protocol):
    """Whole objects by name. ``put`` replaces an object; names never contain ``..``."""

    def put(self, name: str, data: bytes) -> None:
        """Write ``data`` under ``name``; the object is complete when this returns."""

    def get(self, name: str) -> bytes:
        """The object's bytes; raise ``FileNotFoundError`` when there is none."""

    def delete(self, name: str) -> None:
        """Remove the object; a missing object is not an error."""

    def list(self, prefix: str = "") -> list[str]:
        """Names starting with ``prefix``, sorted."""

    def describe(self) -> str:
        """A human-readable location, for logs and errors."""


class FileStore:
    """Objects as files in one directory (local disk or a Blob CSI mount).

    ``put`` writes the final name directly, flushes and fsyncs: no temp file and rename,
    which blobfuse2 turns into a non-atomic copy. Torn writes are caught by checksums.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid object name {name!r}")
        return self.root / name

    def put(self, name: str, data: bytes) -> None:
        with open(self._path(name), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def get(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.name.startswith(prefix))

    def describe(self) -> str:
        return str(self.root)


def open_store(uri: str) -> ObjectStore:
    """A store for a checkpoint URI: ``http(s)://...`` is Azure Blob, anything else a path."""
    if uri.startswith(("https://", "http://")):
        from training.blob_store import BlobStore  # optional deps: only the blob backend needs them

        return BlobStore.from_uri(uri)
    return FileStore(uri)
