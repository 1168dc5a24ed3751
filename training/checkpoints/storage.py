"""Where checkpoints live: a tiny object-store interface over a directory or Azure Blob.

The checkpoint protocol (``training/checkpoints/checkpoint.py``) needs whole-object put/get,
an atomic create-if-absent, delete, and a listing with modification times, all answered
consistently, and a receipt for each put: the size the store now holds under that name.
Blob Storage's API gives all of that. A local filesystem does too (create-if-absent is a hard
link). A blobfuse2 mount does not: its caches serve stale listings and reads across nodes,
and it has no atomic create-if-absent, so ``FileStore`` refuses a directory on one.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Protocol

from training.checkpoints.deadline import Deadline

# FUSE filesystems (blobfuse2 shows as "fuse" or "fuse.blobfuse2") cache listings and reads
# per node, and most cannot link: none is trusted with a manifest.
_UNSAFE_FILESYSTEM_PREFIX = "fuse"
CHUNK_BYTES = 4 * 1024 * 1024
"""What a streamed read holds at once."""


class ObjectStore(Protocol):
    """Whole objects by name. ``put`` replaces an object; names never contain ``..``."""

    def put(self, name: str, data: bytes | Path) -> int:
        """Write ``data`` (bytes, or a local file's) under ``name``; the object is complete when
        this returns, and the result is its size as the store now holds it (the receipt)."""

    def put_new(self, name: str, data: bytes) -> None:
        """Create ``name`` only if it does not exist, atomically: ``FileExistsError`` if it does.

        Two writers racing for one name: exactly one succeeds, and no reader ever sees a
        partial object under that name.
        """

    def get(self, name: str) -> bytes:
        """The object's bytes; raise ``FileNotFoundError`` when there is none."""

    def get_into(self, name: str, sink: BinaryIO) -> int:
        """Stream the object's bytes, in order, into ``sink`` (which need not seek); the number
        written. ``FileNotFoundError`` when there is none. For objects too large to hold."""

    def size(self, name: str) -> int:
        """The object's size as the store holds it, without reading it; ``FileNotFoundError``
        when there is none."""

    def delete(self, name: str) -> None:
        """Remove the object; a missing object is not an error."""

    def list(self, prefix: str = "") -> list[str]:
        """Names starting with ``prefix``, sorted."""

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """Names starting with ``prefix``, each with its last write (seconds since the epoch)."""

    def now(self) -> float:
        """The time, on the clock ``list_modified`` reports in."""

    def describe(self) -> str:
        """A human-readable location, for logs and errors."""

    def bounded(self, deadline: Deadline) -> ObjectStore:
        """This store with every call's timeouts cut to fit ``deadline`` (a store whose calls
        cannot hang on a remote peer may return itself)."""


class FileStore:
    """Objects as files in one directory (local disk or a Blob CSI mount).

    ``put`` writes the final name directly, flushes and fsyncs; torn writes are caught by
    checksums. A file on the same filesystem is hard-linked instead of copied. ``put_new``
    writes a hidden temporary file and hard-links it to the name, which the kernel does
    atomically and refuses when the name exists. ``fsync=False`` skips the fsync of ``put``
    (node-local copies: they must outlive the process, and a crash of the node's kernel
    leaves at worst an object whose checksum fails, which readers skip).
    """

    def __init__(self, root: str | Path, mountinfo: str | None = None, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        fstype = filesystem_type(self.root.resolve(), mountinfo)
        if fstype.startswith(_UNSAFE_FILESYSTEM_PREFIX):
            raise ValueError(
                f"checkpoint directory {self.root} is on a {fstype} mount, whose caches serve "
                "stale reads across nodes and which cannot create a file only if it is absent: "
                "use the Blob URI https://<account>.blob.core.windows.net/<container>/<prefix>"
            )

    def _path(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid object name {name!r}")
        return self.root / name

    def put(self, name: str, data: bytes | Path) -> int:
        path = self._path(name)
        if isinstance(data, Path):
            _link_or_copy(data, path)
            if self.fsync:
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            return path.stat().st_size
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
            return os.fstat(f.fileno()).st_size

    def put_new(self, name: str, data: bytes) -> None:
        final = self._path(name)
        temporary = self.root / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(temporary, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(temporary, final)  # atomic; FileExistsError when another writer won
        finally:
            temporary.unlink(missing_ok=True)

    def get(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def get_into(self, name: str, sink: BinaryIO) -> int:
        written = 0
        with open(self._path(name), "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                sink.write(chunk)
                written += len(chunk)
        return written

    def link_into(self, name: str, path: Path) -> bool:
        """``path`` becomes the object ``name`` without a copy (a hard link): True; False when
        the two are on different filesystems, or this one cannot link. A checkpoint's files
        are put from files only, which replaces the name by a new file: the link keeps the
        bytes it was made with."""
        try:
            os.link(self._path(name), path)
        except OSError as exc:
            if exc.errno not in _CANNOT_LINK:
                raise
            return False
        return True

    def size(self, name: str) -> int:
        return self._path(name).stat().st_size

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_modified(prefix))

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        found = {}
        for path in self.root.iterdir():
            if path.name.startswith(prefix) and not path.name.startswith("."):
                try:
                    found[path.name] = path.stat().st_mtime
                except FileNotFoundError:
                    continue  # deleted since the listing
        return dict(sorted(found.items()))

    def now(self) -> float:
        return time.time()

    def describe(self) -> str:
        return str(self.root)

    def bounded(self, deadline: Deadline) -> FileStore:
        return self  # a local disk has no timeouts to set; the caller's deadline cuts it off


_CANNOT_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP)
"""What ``os.link`` raises across filesystems, or on one that has no hard links."""


def _link_or_copy(source: Path, target: Path) -> None:
    """``target`` becomes a file with ``source``'s bytes: a hard link when both are on one
    filesystem (no copy at all), else a copy."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in _CANNOT_LINK:
            raise
        shutil.copyfile(source, target)


def filesystem_type(path: Path, mountinfo: str | None = None) -> str:
    """The type of the filesystem ``path`` (absolute, resolved) lives on, from mountinfo.

    "" when unknown (no ``/proc``: not Linux).
    """
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return ""
    best, fstype = "", ""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount_point = fields[4].replace("\\040", " ")
        after = line.split(" - ", 1)[1].split()
        inside = str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best) and after:
            best, fstype = mount_point, after[0]
    return fstype
