"""Which store a checkpoint URI names: Azure Blob for ``http(s)://``, a directory otherwise; and
the one seam to put something in front of it (``wrap``).

Apart from ``storage.py`` (the interface and the directory store) so that a wrapper can wrap
any store without a cycle.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping

from training.checkpoints.storage import FileStore, ObjectStore

Wrap = Callable[[ObjectStore], ObjectStore]
"""A store in front of the store a URI names (a store that logs its calls, or slows them)."""
STORE_WRAP_ENV = "TRAIN_STORE_WRAP"
"""``module:callable``, a ``Wrap`` that every ``open_store`` of the process applies when its
caller gave none: how a test or the chaos bench reaches the stores of the workers it starts
(``bench/chaos/faulty_store.py``). Nothing in the cluster sets it."""


def open_store(uri: str, wrap: Wrap | None = None) -> ObjectStore:
    """A store for a checkpoint URI: ``http(s)://...`` is Azure Blob, anything else a path;
    behind ``wrap``, or the one ``TRAIN_STORE_WRAP`` names, when there is one."""
    store: ObjectStore
    if uri.startswith(("https://", "http://")):
        # Optional deps: only the blob backend needs them.
        from training.checkpoints.blob_store import BlobStore

        store = BlobStore.from_uri(uri)
    else:
        store = FileStore(uri)
    wrap = wrap or wrap_from_env(os.environ)
    return wrap(store) if wrap is not None else store


def wrap_from_env(environ: Mapping[str, str]) -> Wrap | None:
    """The ``Wrap`` that ``TRAIN_STORE_WRAP`` names in ``environ``, or None when it is unset."""
    spec = environ.get(STORE_WRAP_ENV)
    if not spec:
        return None
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{STORE_WRAP_ENV} must be module:callable, got {spec!r}")
    try:
        wrap = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{STORE_WRAP_ENV}={spec}: {exc}") from exc
    if not callable(wrap):
        raise ValueError(f"{STORE_WRAP_ENV}={spec} is not callable")
    return wrap
