"""Which store a checkpoint URI names: Azure Blob for ``http(s)://``, a directory otherwise.

Apart from ``storage.py`` (the interface and the directory store) so that the faulty store of
the tests and the chaos bench (``faulty_store.py``) can wrap any store without a cycle.
"""

from __future__ import annotations

import os

from training.checkpoints.faulty_store import FAULTY_STORE_ENV
from training.checkpoints.storage import FileStore, ObjectStore


def open_store(uri: str) -> ObjectStore:
    """A store for a checkpoint URI: ``http(s)://...`` is Azure Blob, anything else a path.

    Tests and the chaos bench only: ``TRAIN_FAULTY_STORE`` puts injected delays and failures
    in front of it (``faulty_store.py``); nothing in the cluster sets it.
    """
    store: ObjectStore
    if uri.startswith(("https://", "http://")):
        # Optional deps: only the blob backend needs them.
        from training.checkpoints.blob_store import BlobStore

        store = BlobStore.from_uri(uri)
    else:
        store = FileStore(uri)
    if os.environ.get(FAULTY_STORE_ENV):
        from training.checkpoints.faulty_store import FaultyStore

        return FaultyStore.from_env(store)
    return store
