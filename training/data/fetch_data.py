"""Copy the dataset to node-local disk when the pod starts: from its read-only Blob CSI mount on
the cluster, or from a Blob URL through the API, always with the pod's own identity.

On the cluster the ``data`` container is mounted read-only into each worker pod; blobfuse2
signs in with the pod's workload identity token (``workloads/manifests/volume.py``). The agent
copies the batches from the mount before it joins the rendezvous: the mount's token is fresh
then on every driver version (before Blob CSI v1.27 it is never refreshed and stops working
after about a day), and training reads local disk, not FUSE. The copy sits in the pod's
``emptyDir``, so a container that restarts in the same pod finds it there and copies nothing.
A ``https://`` source is read through the Blob API instead (outside the cluster).

The agent (``training/agent.py``) calls this before it joins the rendezvous, when
``TRAIN_DATA_URI`` is set, into ``TRAIN_DATA_DIR``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from training.checkpoints.storage import ObjectStore
from training.data.sources import CORPUS_FILE, DATA_FILE
from training.elastic.launch import DATA_URI_ENV

logger = logging.getLogger(__name__)

MARKER = ".fetched.json"
"""Written last, naming what was copied: a copy cut short is never taken for a whole one."""
ROLE_WAIT_S = 300.0
"""How long a refused read is retried: a new role assignment can take minutes to apply."""


class DataFetchError(ValueError):
    """The data is not there, or this identity may not read it: no retry by a new pod helps.

    Defined here, not in ``training.data.cifar10``, so that the agent copies the data before it
    imports torch (the fork server's imports overlap the agent's).
    """


def fetch_dataset(
    uri: str,
    dest: str | Path,
    *,
    role_wait_s: float = ROLE_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Path]:
    """Copy every data file (CIFAR-10's batches, a corpus) under ``uri`` (a mounted directory
    or a Blob URL) into ``dest``; the local paths.

    Raises DataFetchError (no retry helps) when the source holds no training batches, is not
    mounted, or the identity stays refused for ``role_wait_s``; OSError (ConnectionError, a
    broken mount, ...) when the store cannot be read, which a new pod may not meet.
    """
    store = _source(uri)
    names = _listed(store, uri, role_wait_s, sleep)
    if not any(name.startswith("data_batch_") or name == CORPUS_FILE for name in names):
        raise DataFetchError(
            f"{DATA_URI_ENV} {uri} holds no data_batch_N.bin nor {CORPUS_FILE}: stage the task's "
            "data with `pulumi up` (dataSourceUrl), or upload it with `az storage blob "
            "upload-batch --auth-mode login`"
        )
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    if _already_fetched(root, uri, names):
        logger.info("dataset from %s already in %s", uri, root)
        return [root / name for name in names]
    (root / MARKER).unlink(missing_ok=True)
    started, total = time.monotonic(), 0
    sizes = {}
    for name in names:
        data = store.get(name)
        partial = root / f".{name}.partial"
        partial.write_bytes(data)
        os.replace(partial, root / name)  # local disk: a rename is atomic here
        sizes[name] = len(data)
        total += len(data)
    (root / MARKER).write_text(json.dumps({"source": uri, "files": sizes}))
    logger.info(
        "copied %d files (%.1f MB) from %s to %s in %.1f s",
        len(names),
        total / 1e6,
        uri,
        root,
        time.monotonic() - started,
    )
    return [root / name for name in names]


class MountedDirectory:
    """The files of a read-only directory (the dataset's mount), as much of a store as a copy
    needs. Not ``FileStore``: that one is for checkpoints and refuses FUSE mounts."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def list(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_file())

    def get(self, name: str) -> bytes:
        return (self.root / name).read_bytes()


def _source(uri: str) -> ObjectStore | MountedDirectory:
    """Where the batches come from: the Blob API for a URL, else a mounted directory."""
    if uri.startswith(("https://", "http://")):
        from training.checkpoints.blob_store import (
            BlobStore,  # optional deps: only the cloud path needs them
        )

        return BlobStore.from_uri(uri)
    root = Path(uri)
    if not root.is_dir():
        raise DataFetchError(
            f"{DATA_URI_ENV} {uri} is not a directory: the dataset volume is not mounted there "
            "(the pod's volumeMounts and the PyTorchJob's TRAIN_DATA_URI must name the same path)"
        )
    return MountedDirectory(root)


def _listed(
    store: ObjectStore | MountedDirectory,
    uri: str,
    role_wait_s: float,
    sleep: Callable[[float], None],
) -> list[str]:
    """The batch files in the container, retrying a refusal while a new role applies."""
    deadline = time.monotonic() + role_wait_s
    while True:
        try:
            return [name for name in store.list() if DATA_FILE.match(name)]
        except PermissionError as exc:
            if time.monotonic() >= deadline:
                raise DataFetchError(
                    f"{DATA_URI_ENV} {uri}: still refused after {role_wait_s:.0f} s ({exc}). "
                    "The training identity needs Storage Blob Data Reader on the data container"
                ) from exc
            logger.warning("reading %s refused (%s); a new role may not apply yet", uri, exc)
            sleep(10.0)


def _already_fetched(root: Path, uri: str, names: list[str]) -> bool:
    try:
        marker = json.loads((root / MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return False
    files = marker.get("files", {})
    if marker.get("source") != uri or sorted(files) != sorted(names):
        return False
    return all((root / n).is_file() and (root / n).stat().st_size == s for n, s in files.items())
