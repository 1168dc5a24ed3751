"""A run's stored records (``training/loop/run_records.py``) back as the pod logs the report reads:
every node's objects, in the order they were written, as ``pods/<node>.log``. ``lab report``
then builds the same report and plot as from the logs ``lab watch`` saved, after the job ended
or its pods were evicted, their stdout long gone."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from training.loop.run_records import RECORDS_FOLDER


def records_of(checkpoint_uri: str) -> str:
    """Where a run whose checkpoints are at ``checkpoint_uri`` stores its records (the
    training's default, ``--records-uri`` empty)."""
    return f"{checkpoint_uri.rstrip('/')}/{RECORDS_FOLDER}"


def fetch_records(uri: str, out: Path, environ: Mapping[str, str]) -> int:
    """Write the records at ``uri`` (a directory or a Blob URL) into ``out/pods``; the number of
    objects read. ValueError when there are none (a wrong place, or a run that stored none)."""
    from training.checkpoints.storage import FileStore, ObjectStore

    store: ObjectStore
    if uri.startswith(("https://", "http://")):
        from lab.azure.clients import storage_credential
        from training.checkpoints.blob_store import BlobStore, parse_blob_uri

        store = BlobStore(parse_blob_uri(uri), storage_credential(uri, environ))
    elif Path(uri).is_dir():
        store = FileStore(uri)
    else:
        raise ValueError(f"{uri} is not a directory of run records")
    names = [n for n in store.list() if n.endswith(".jsonl") and "_" in n]
    if not names:
        raise ValueError(f"{store.describe()} holds no run records (.jsonl objects)")
    pods = out / "pods"
    pods.mkdir(parents=True, exist_ok=True)
    for node in sorted({n.split("_", 1)[0] for n in names}):
        with open(pods / f"{node}.log", "wb") as log:
            for name in sorted(n for n in names if n.split("_", 1)[0] == node):
                store.get_into(name, log)
    return len(names)
