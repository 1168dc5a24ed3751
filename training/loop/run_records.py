"""A run's history in its own storage: each process's metrics and events, a small object per
interval, so ``lab report --stack`` rebuilds the report after the pods (and their stdout) are
gone.

The records are the JSON lines the ``EventLog`` prints (``metrics.py``), written again through
its sink. ``StoredRecords`` keeps them in memory and a thread of its own uploads what gathered
every ``interval_s`` (or sooner, once ``flush_bytes`` gathered) as one new object, named so that
a node's objects sort in the order they were written: ``<node>_<start><writer>_<seq>.jsonl``.
A step costs an append to a deque; a store that fails keeps the lines for the next try, up to
``max_bytes``, past which the oldest are dropped (one per line written, and counted in the next
object's first line). Each upload takes its sequence number when it takes its lines, so the
thread's upload and the one ``close`` makes at the end are two objects, never one name twice;
objects are only ever created, never rewritten, so no two writers race for one.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque

from training.checkpoints.deadline import Deadline
from training.checkpoints.storage import ObjectStore
from training.records import EVENT, RECORDS_DROPPED

logger = logging.getLogger(__name__)

RECORDS_FOLDER = "records"
"""Beside a run's checkpoints: ``<checkpoint-uri>/records``."""
NODE_ENV = "TRAIN_NODE_NAME"
"""The name a node's records go under; the host's name (a pod's name) without it."""
OFF = "off"
CLOSE_S = 3.0
"""What the last upload may take when the process ends: an eviction's SIGTERM leaves the worker
seconds, which its save needs more."""


def records_uri(setting: str, checkpoint_uri: str) -> str | None:
    """Where the records go for ``--records-uri`` ``setting``: as given; beside checkpoints in
    Blob when empty (a directory's: nowhere, local runs keep their logs); None for ``off``."""
    if setting == OFF:
        return None
    if setting:
        return setting
    if checkpoint_uri.startswith(("https://", "http://")):
        return f"{checkpoint_uri.rstrip('/')}/{RECORDS_FOLDER}"
    return None


def node_name() -> str:
    """What this node's records are filed under (``_`` is the objects' separator)."""
    return (os.environ.get(NODE_ENV) or socket.gethostname()).replace("_", "-")


class StoredRecords:
    """A ``RecordSink``: the lines, gathered and uploaded as objects by a thread of its own."""

    def __init__(
        self,
        store: ObjectStore,
        node: str,
        interval_s: float = 30.0,
        flush_bytes: int = 1 << 20,
        max_bytes: int = 16 << 20,
    ) -> None:
        self.store, self.interval_s = store, interval_s
        self.flush_bytes, self.max_bytes = flush_bytes, max_bytes
        self._prefix = f"{node}_{int(time.time() * 1000):013d}{uuid.uuid4().hex[:6]}"
        self._seq, self._size, self._dropped = 0, 0, 0
        self._lines: deque[str] = deque()
        self._lock = threading.Lock()
        self._wake, self._stopped = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="run-records", daemon=True)
        self._thread.start()

    def write(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
            self._size += len(line) + 1
            while self._size > self.max_bytes and len(self._lines) > 1:
                self._size -= len(self._lines.popleft()) + 1
                self._dropped += 1
            if self._size >= self.flush_bytes:
                self._wake.set()

    def flush(self, store: ObjectStore | None = None) -> bool:
        """Upload what gathered as one object (through ``store``, a bounded view, if given);
        False when the store failed or took too long (the lines are kept for later)."""
        with self._lock:
            if not self._lines:
                return True
            taken, dropped = self._lines, self._dropped
            self._lines, self._size, self._dropped = deque(), 0, 0
            seq, self._seq = self._seq, self._seq + 1  # this upload's name, whatever else runs
        lines = list(taken)
        if dropped:  # what the buffer could not keep while the store failed
            lost = {"ts": round(time.time(), 3), "kind": EVENT, "event": RECORDS_DROPPED}
            lines.insert(0, json.dumps({**lost, "lines": dropped}))
        name = f"{self._prefix}_{seq:06d}.jsonl"
        try:
            (store or self.store).put(name, ("\n".join(lines) + "\n").encode())
        except OSError as exc:
            logger.warning("cannot store %d record lines in %s: %s", len(lines), name, exc)
            kept, size = deque(taken), sum(len(line) + 1 for line in taken)
            with self._lock:  # before what came since: only that much is moved here
                kept.extend(self._lines)
                self._lines = kept
                self._size += size
                self._dropped += dropped
            return False
        return True

    def close(self, deadline: Deadline | None = None) -> None:
        """Upload what is left, once, within ``CLOSE_S`` and before ``deadline`` (a SIGTERM's
        stop deadline: the margin after it is the process's, to exit with its code); the
        thread stops (an upload of its still under way goes on while the process lives)."""
        self._stopped.set()
        self._wake.set()
        try:
            budget = Deadline.after(min(CLOSE_S, deadline.remaining()) if deadline else CLOSE_S)
            self._thread.join(timeout=min(1.0, budget.remaining()))
            if budget.expired:
                logger.warning("no time left to store the run's last %d records", len(self._lines))
            else:
                self.flush(self.store.bounded(budget))
        except Exception:  # the process ends next, whatever the store did: say it and go on
            logger.exception("the run's last records were not stored")

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._stopped.is_set():
                self.flush()


def open_records(setting: str, checkpoint_uri: str) -> StoredRecords | None:
    """The sink for ``--records-uri``, or None (off, or a store that cannot be opened: the
    run's logs still go to stdout, and training does not stop for its history)."""
    uri = records_uri(setting, checkpoint_uri)
    if uri is None:
        return None
    from training.checkpoints.stores import open_store

    try:
        return StoredRecords(open_store(uri), node_name())
    except (OSError, ValueError) as exc:
        logger.warning("--records-uri %s: the run's records stay in its logs only: %s", uri, exc)
        return None
