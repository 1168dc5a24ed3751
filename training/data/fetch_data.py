"""Copy the dataset to node-local disk when the pod starts: every file under the data source,
streamed and verified, resumed where a restarted container left it.

On the cluster the ``data`` container is mounted read-only into each worker pod; blobfuse2
signs in with the pod's workload identity token (``workloads/manifests/volume.py``). The agent
copies from the mount before it joins the rendezvous: the mount's token is fresh then on every
driver version (before Blob CSI v1.27 it is never refreshed and stops working after about a
day), and training reads local disk, not FUSE. A ``https://`` source is read through the Blob
API instead (outside the cluster). ``TRAIN_DATA_URI`` may name a folder of either.

- **It waits for the data.** Nothing is copied before the source's completion marker
  (``dataset_marker.py``) and every file it lists are there: a job started in the same ``up``
  as its storage waits for ``python -m lab data upload`` (a ``data_waiting`` event each poll,
  which ``lab watch`` shows) instead of failing for good. On the mount a marker written after
  the pod looked for it shows within blobfuse2's negative-lookup cache, 120 s by default
  (azure-storage-fuse ``component/libfuse/libfuse.go``, ``defaultNegativeEntryExpiration``;
  the volume sets no cache option), plus one ``POLL_S``; sizes that lag the same way (its
  attribute cache, also 120 s) keep it waiting, never copying a short file.
- **Any layout.** Every file under the root, nested folders too, lands at the same relative
  path under ``TRAIN_DATA_DIR``, which is what the task's ``load_data`` reads as ``--data-dir``.
- **Bounded memory.** Each file streams through in ``CHUNK_BYTES`` pieces and is hashed on the
  way; it takes its name only once its size and SHA-256 match the marker's.
- **Resumable.** The copy sits in the pod's ``emptyDir``, so a container that restarts in the
  same pod finds it: a file whose verified copy is journalled is not read again, and a file cut
  off mid-way goes on from the bytes already on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any, Protocol

from training import records
from training.data.dataset_marker import CHUNK_BYTES, MARKER, DataFile, parse_marker
from training.elastic.launch import DATA_URI_ENV

logger = logging.getLogger(__name__)

COPIED = ".fetched.json"
"""Written last in the local copy, naming what was copied."""
WORK_DIR = ".fetch"
"""In the local copy: the journal of verified files and the files on their way."""
ROLE_WAIT_S = 300.0
"""How long a refused read is retried: a new role assignment can take minutes to apply."""
POLL_S = 30.0
"""Between two looks for the data while it is not there yet."""
UPLOAD_HINT = "upload it with `python -m lab data upload --stack NAME DIR`"


class DataFetchError(ValueError):
    """The data is wrong, or this identity may not read it: no retry by a new pod helps.

    Defined here, not in ``training.data.cifar10``, so that the agent copies the data before it
    imports torch (the fork server's imports overlap the agent's).
    """


class DataSource(Protocol):
    """The files under a data source's root, as much of a store as the copy needs."""

    def marker(self) -> bytes | None:
        """The completion marker's bytes; None while there is none."""

    def files(self) -> dict[str, int]:
        """Every file under the root but the marker, by relative path, with its size."""

    def chunks(self, path: str, offset: int) -> Iterator[bytes]:
        """The file's bytes from ``offset`` on, a bounded chunk at a time."""


def say(event: str, **fields: Any) -> None:
    """One of the agent's records on stdout, as the training's are (``lab watch`` reads it)."""
    record = {"ts": round(time.time(), 3), "kind": records.EVENT, "event": event, "rank": None}
    records.check(record | fields)
    sys.stdout.write(json.dumps(record | fields) + "\n")
    sys.stdout.flush()


def fetch_dataset(
    uri: str,
    dest: str | Path,
    *,
    wait_s: float = math.inf,
    poll_s: float = POLL_S,
    role_wait_s: float = ROLE_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Path]:
    """Copy every file under ``uri`` (a mounted directory or a Blob URL) into ``dest``, once
    the source's marker says the upload is whole; the local paths.

    Raises DataFetchError (no retry helps) when the data does not match its marker, the source
    is not mounted, the identity stays refused for ``role_wait_s`` or the data stays absent for
    ``wait_s``; OSError (ConnectionError, a broken mount, ...) when the store cannot be read,
    which a new pod may not meet.
    """
    source = _source(uri)
    files, marker = _wait_for_data(source, uri, wait_s, poll_s, role_wait_s, sleep)
    root = Path(dest)
    (root / WORK_DIR).mkdir(parents=True, exist_ok=True)
    (root / COPIED).unlink(missing_ok=True)
    journal = Journal(root / WORK_DIR / "copied.jsonl")
    started, copied, read = time.monotonic(), 0, 0
    for path in sorted(files):
        if journal.holds(files[path], root):
            continue
        read += copy_file(source, files[path], root, journal)
        copied += 1
    total = sum(f.size for f in files.values())
    digest = hashlib.sha256(marker).hexdigest()
    (root / COPIED).write_text(json.dumps({"source": uri, "marker_sha256": digest, "bytes": total}))
    seconds = round(time.monotonic() - started, 1)
    say("data_copied", uri=uri, files=len(files), copied=copied, bytes_read=read, seconds=seconds)
    logger.info("dataset from %s in %s: %d files, %d copied now", uri, root, len(files), copied)
    return [root / path for path in sorted(files)]


def _wait_for_data(
    source: DataSource,
    uri: str,
    wait_s: float,
    poll_s: float,
    role_wait_s: float,
    sleep: Callable[[float], None],
) -> tuple[dict[str, DataFile], bytes]:
    """The files to copy and the marker's bytes, once the marker and every file it lists are
    there; a ``data_waiting`` event each poll until then."""
    started, refused_since = time.monotonic(), None
    while True:
        try:
            found = _complete(source, uri)
        except PermissionError as exc:
            now = time.monotonic()
            refused_since = refused_since or now
            if now - refused_since >= role_wait_s:
                raise DataFetchError(
                    f"{DATA_URI_ENV} {uri}: still refused after {role_wait_s:.0f} s ({exc}). "
                    "The training identity needs Storage Blob Data Reader on the data container"
                ) from exc
            logger.warning("reading %s refused (%s); a new role may not apply yet", uri, exc)
            sleep(10.0)
            continue
        if isinstance(found, tuple):
            return found
        waited = time.monotonic() - started
        if waited >= wait_s:
            raise DataFetchError(f"{DATA_URI_ENV} {uri}: {found} after {waited:.0f} s")
        say("data_waiting", uri=uri, why=found, waited_s=round(waited), hint=UPLOAD_HINT)
        logger.info("waiting for the dataset: %s; %s", found, UPLOAD_HINT)
        sleep(poll_s)


def _complete(source: DataSource, uri: str) -> tuple[dict[str, DataFile], bytes] | str:
    """What to copy, or why the data is not whole yet."""
    raw = source.marker()
    if raw is None:
        return f"no {MARKER} in {uri} yet (the upload writes it last)"
    try:
        listed = parse_marker(raw, f"{uri}/{MARKER}")
    except ValueError as exc:
        raise DataFetchError(str(exc)) from None
    found = source.files()
    files = listed or {path: DataFile(path, size) for path, size in found.items()}
    if not files:
        raise DataFetchError(f"{DATA_URI_ENV} {uri} holds {MARKER} but no file: {UPLOAD_HINT}")
    missing = sorted(p for p, f in files.items() if found.get(p) != f.size)
    if missing:  # a listing that lags the upload: the marker was written after them
        count, first = len(missing), missing[0]
        return f"{count} of the {len(files)} files {MARKER} lists are not there yet ({first})"
    return files, raw


class Journal:
    """The files of the local copy that were verified, one JSON line each, appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        with suppress(FileNotFoundError), open(path) as lines:
            for line in lines:
                with suppress(ValueError):  # a line cut off when the container died
                    entry = json.loads(line)
                    self.done[entry["path"]] = entry

    def holds(self, file: DataFile, root: Path) -> bool:
        """Whether ``file``'s verified copy is in place under ``root``."""
        entry = self.done.get(file.path)
        if entry is None or entry["size"] != file.size:
            return False
        if file.sha256 is not None and entry["sha256"] != file.sha256:
            return False
        local = root / file.path
        return local.is_file() and local.stat().st_size == file.size

    def add(self, file: DataFile, sha256: str) -> None:
        entry = {"path": file.path, "size": file.size, "sha256": sha256}
        with open(self.path, "a") as out:
            out.write(json.dumps(entry) + "\n")
        self.done[file.path] = entry


def copy_file(source: DataSource, file: DataFile, root: Path, journal: Journal) -> int:
    """Stream ``file`` to ``root``, verified, resuming a copy cut off before; the bytes read
    from the source. A copy that does not verify is taken again once from its first byte."""
    partial = root / WORK_DIR / "partial" / file.path
    partial.parent.mkdir(parents=True, exist_ok=True)
    read = 0
    for attempt in (1, 2):
        digest, have = hashlib.sha256(), 0
        if partial.exists() and partial.stat().st_size <= file.size:
            with open(partial, "rb") as kept:  # hash what the last container wrote
                while chunk := kept.read(CHUNK_BYTES):
                    digest.update(chunk)
                    have += len(chunk)
        with open(partial, "ab" if have else "wb") as out:
            if have < file.size or file.size == 0:
                for chunk in source.chunks(file.path, have):
                    digest.update(chunk)
                    out.write(chunk)
                    have += len(chunk)
                    read += len(chunk)
        if have == file.size and file.sha256 in (None, digest.hexdigest()):
            local = root / file.path
            local.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, local)  # local disk: a rename is atomic here
            journal.add(file, digest.hexdigest())
            return read
        partial.unlink()
        if attempt == 2:
            raise DataFetchError(
                f"{file.path}: read {have} bytes (SHA-256 {digest.hexdigest()[:12]}...), but "
                f"{MARKER} lists {file.size} bytes (SHA-256 {(file.sha256 or '?')[:12]}...): the "
                f"data changed after its marker was written; {UPLOAD_HINT} again"
            )
        logger.warning("%s did not verify; copying it again from its first byte", file.path)
    raise AssertionError("unreachable")


class MountedDirectory:
    """The files of a read-only directory (the dataset's mount). Not ``FileStore``: that one
    is for checkpoints, flat, and refuses FUSE mounts."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def marker(self) -> bytes | None:
        try:
            return (self.root / MARKER).read_bytes()
        except FileNotFoundError:
            return None

    def files(self) -> dict[str, int]:
        found = {}

        def refused(error: OSError) -> None:  # os.walk drops errors unless told
            raise error

        for folder, _, names in os.walk(self.root, onerror=refused):
            for name in names:
                path = Path(folder) / name
                relative = path.relative_to(self.root).as_posix()
                if relative != MARKER and path.is_file():
                    found[relative] = path.stat().st_size
        return found

    def chunks(self, path: str, offset: int) -> Iterator[bytes]:
        with open(self.root / path, "rb") as source:
            source.seek(offset)
            while chunk := source.read(CHUNK_BYTES):
                yield chunk


def _source(uri: str) -> DataSource:
    """Where the files come from: the Blob API for a URL, else a mounted directory."""
    if uri.startswith(("https://", "http://")):
        from training.data.blob_source import BlobSource  # the SDK: only the cloud path

        return BlobSource.from_uri(uri)
    root = Path(uri)
    if not root.is_dir():
        raise DataFetchError(
            f"{DATA_URI_ENV} {uri} is not a directory: the dataset volume is not mounted there "
            "(the pod's volumeMounts and the PyTorchJob's TRAIN_DATA_URI must name the same path)"
        )
    return MountedDirectory(root)
