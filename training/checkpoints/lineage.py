"""The lineage id of a checkpoint store: which history the store holds.

Created once, with create-if-absent, in a store that has none (a new one, or one emptied by
hand), and read by every worker at start. Copies kept outside the store (node-local emergency
saves) are keyed by it, so a run restarted under the same id over an emptied store never
resumes a step of the history that was deleted. The record matches no pruning pattern, so it
is never deleted.
"""

from __future__ import annotations

import json
import re
import uuid
from contextlib import suppress

from training.checkpoints.manifest import CheckpointError
from training.checkpoints.storage import ObjectStore

_LINEAGE = re.compile(r"^[0-9a-f]{32}$")


def lineage_name(prefix: str) -> str:
    return f"{prefix}-lineage.json"


def decode_lineage(data: bytes) -> str | None:
    """The lineage id a lineage record holds; None when it is not one."""
    try:
        lineage = json.loads(data)["lineage"]
    except (ValueError, KeyError, TypeError):
        return None
    return lineage if isinstance(lineage, str) and _LINEAGE.match(lineage) else None


def store_lineage(store: ObjectStore, prefix: str = "ckpt") -> str:
    """The store's lineage id, created (create-if-absent: one writer wins) if it has none."""
    name = lineage_name(prefix)
    for _ in range(2):
        try:
            data = store.get(name)
        except FileNotFoundError:
            # Another rank may have created it first: then read theirs.
            with suppress(FileExistsError):
                store.put_new(name, json.dumps({"lineage": uuid.uuid4().hex}).encode())
            continue
        lineage = decode_lineage(data)
        if lineage is None:
            raise CheckpointError(
                f"{name} in {store.describe()} is not a lineage record; delete it to start a "
                "new lineage (node-local copies of the old one are then ignored)"
            )
        return lineage
    raise CheckpointError(f"{name} in {store.describe()} vanished as it was created")
