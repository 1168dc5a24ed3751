"""A dataset's completion marker: the object that says an upload is whole, and what it holds.

The staging Job (``stage_data.py``) and ``python -m lab data upload`` write ``MARKER`` at the
root of the data source last, after every file; the workers' copy (``fetch_data.py``) waits
until it is there, so a pod that starts before the data never trains on half of it. It lists
each file by its path under the root (``/``-separated, nested folders too) with its size and
SHA-256, which the copy checks as the bytes stream in. A marker written by hand (``{}``, after
``az storage blob upload-batch``) lists nothing: the copy then takes every file it finds, and
checks each one's size against the listing. Pure and free of torch and of the Azure SDKs.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

MARKER = ".staged.json"
"""At the data source's root; its leading '.' keeps it out of the dataset itself."""
CHUNK_BYTES = 4 * 1024 * 1024
"""What one read of a file holds, while it is hashed or copied."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class DataFile:
    """One file of a dataset, as its marker lists it."""

    path: str
    """Relative to the data source's root, ``/``-separated."""
    size: int
    sha256: str | None = None
    """None when the marker does not say (a marker written by hand)."""


def checked_path(path: str) -> str:
    """``path`` when it is a relative path inside the root; ValueError naming it otherwise."""
    parts = PurePosixPath(path).parts
    if not path or path.startswith("/") or "\\" in path or any(p in (".", "..") for p in parts):
        raise ValueError(f"{path!r} is not a relative path inside the dataset")
    if PurePosixPath(path).as_posix() != path:
        raise ValueError(f"{path!r} is not a normalized path (no '//' nor a trailing '/')")
    return path


def marker_body(files: Iterable[DataFile], **about: Any) -> bytes:
    """The marker's bytes: ``about`` (where the data came from) and every file."""
    listed = {f.path: {"size": f.size, "sha256": f.sha256} for f in files}
    return json.dumps({**about, "files": listed}, sort_keys=True).encode()


def parse_marker(data: bytes, where: str) -> dict[str, DataFile] | None:
    """The files a marker lists, by path; None when it lists none (every file counts).
    ValueError naming ``where`` and the fix when it is not a marker."""
    fix = "write it again with `python -m lab data upload`"
    try:
        body = json.loads(data)
    except ValueError:
        raise ValueError(f"{where} is not JSON: {fix}") from None
    listed = body.get("files") if isinstance(body, dict) else None
    if not isinstance(body, dict) or not isinstance(listed, Mapping | list | None):
        raise ValueError(f"{where} must be a JSON object whose files map paths to sizes: {fix}")
    if not listed:
        return None
    if isinstance(listed, list):  # an older staging Job's names alone: every file counts
        return None
    files = {}
    for path, about in listed.items():
        size, digest = (about or {}).get("size"), (about or {}).get("sha256")
        if not isinstance(size, int) or size < 0 or not (digest is None or _SHA256.match(digest)):
            raise ValueError(f"{where}: {path!r} needs a size >= 0 and a sha256 (hex): {fix}")
        files[checked_path(path)] = DataFile(path, size, digest)
    return files


def file_digest(source: BinaryIO) -> tuple[int, str]:
    """(size, SHA-256) of what ``source`` reads, a chunk at a time."""
    digest, size = hashlib.sha256(), 0
    while chunk := source.read(CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def local_file(root: Path, path: Path) -> DataFile:
    """``path`` (under ``root``) as the marker lists it, hashed as it is read."""
    with open(path, "rb") as source:
        size, digest = file_digest(source)
    return DataFile(path.relative_to(root).as_posix(), size, digest)
