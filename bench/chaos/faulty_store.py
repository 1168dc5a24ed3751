"""A checkpoint store that is slow or fails on cue, for the chaos campaign and the tests.

A worker's stores reach it through ``open_store``'s seam: ``faulty_env`` is what a node is
started with, ``TRAIN_STORE_WRAP`` naming ``from_env`` (training/checkpoints/stores.py), which
wraps each store in a ``FaultyStore`` of the control file ``TRAIN_FAULTY_STORE`` names. Nothing
in the cluster sets either, and the training image does not hold this module.
The control file holds JSON lines, each a window of trouble the bench appends while the job
runs (``python -m bench chaos``):

    {"from": <epoch s>, "until": <epoch s>, "delay_s": 0.5, "fail": false, "ops": ["put"]}

Every store call inside a window waits ``delay_s`` (the most of the windows it falls in), then
fails with an ``OSError`` if any says ``fail``; ``ops`` limits a window to those calls (all
when absent). A delay longer than a bounded view's deadline ends as ``DeadlineExceeded``, as a
real store's per-call timeout would. When ``TRAIN_FAULTY_STORE_LOG`` names a file, the start
of each checkpoint upload (``"what": "upload"``, a single file or a rank's file of a sharded
checkpoint: the bench and the tests land a SIGTERM in an upload by it)
and every call, once it returned (``"what": "call"``: its start ``ts``, ``duration_s``, the
injected ``delay_s`` and its ``outcome``: ok, failed, timed out, or the error's class), are
appended to it as JSON lines: the bench judges a lost step by what the store really did.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from training.checkpoints.deadline import Deadline, DeadlineExceeded
from training.checkpoints.storage import ObjectStore
from training.checkpoints.stores import STORE_WRAP_ENV

FAULTY_STORE_ENV = "TRAIN_FAULTY_STORE"
FAULTY_STORE_LOG_ENV = "TRAIN_FAULTY_STORE_LOG"
T = TypeVar("T")
OPS = ("put", "put_new", "get", "delete", "list", "list_modified")
UPLOADS = (".pt", ".distcp")
"""A checkpoint's bulk: a single file's state, a rank's file of a sharded checkpoint."""


@dataclass(frozen=True)
class Trouble:
    """What the windows open at one moment ask of one call."""

    delay_s: float = 0.0
    fail: bool = False


class Windows:
    """The control file's windows, read again whenever the file grew."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._size = -1
        self._windows: list[dict] = []
        self._lock = threading.Lock()

    def trouble(self, op: str, now: float) -> Trouble:
        with self._lock:
            self._reload()
            open_ = [
                w
                for w in self._windows
                if w["from"] <= now < w["until"] and (w.get("ops") is None or op in w["ops"])
            ]
        return Trouble(
            max((float(w.get("delay_s", 0.0)) for w in open_), default=0.0),
            any(w.get("fail", False) for w in open_),
        )

    def _reload(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == self._size:
            return
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]  # the bench may be appending the last line
        self._windows = [json.loads(line) for line in complete.decode().splitlines() if line]
        self._size = len(complete)


class FaultyStore:
    """``inner`` with the control file's delays and failures in front of every call."""

    def __init__(
        self,
        inner: ObjectStore,
        windows: Windows,
        log: Path | None = None,
        deadline: Deadline | None = None,
    ) -> None:
        self.inner, self.windows, self.log, self._deadline = inner, windows, log, deadline

    def _call(self, op: str, name: str, call: Callable[[], T]) -> T:
        """``call`` behind the windows' trouble; logged with its duration and outcome."""
        start = time.time()
        trouble = self.windows.trouble(op, start)
        if op == "put" and name.endswith(UPLOADS):
            self._note({"ts": round(start, 3), "op": op, "name": name, "what": "upload"}, trouble)
        outcome = "ok"
        try:
            if trouble.delay_s:
                left = self._deadline.remaining() if self._deadline else trouble.delay_s
                time.sleep(min(trouble.delay_s, left))
                if trouble.delay_s > left:
                    outcome = "timed out"
                    raise DeadlineExceeded(f"{op} {name!r}: injected delay past the deadline")
            if trouble.fail:
                outcome = "failed"
                raise OSError(f"{op} {name!r}: injected store failure")
            return call()
        except BaseException as exc:
            outcome = outcome if outcome != "ok" else type(exc).__name__
            raise
        finally:
            took = round(time.time() - start, 4)
            line = {"ts": round(start, 4), "op": op, "name": name, "what": "call"}
            self._note(line | {"duration_s": took, "outcome": outcome}, trouble)

    def _note(self, line: dict[str, Any], trouble: Trouble) -> None:
        if self.log is None:
            return
        line |= {"pid": os.getpid(), "delay_s": trouble.delay_s, "fail": trouble.fail}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def put(self, name: str, data: bytes | Path) -> int:
        return self._call("put", name, lambda: self.inner.put(name, data))

    def put_new(self, name: str, data: bytes) -> None:
        self._call("put_new", name, lambda: self.inner.put_new(name, data))

    def get(self, name: str) -> bytes:
        return self._call("get", name, lambda: self.inner.get(name))

    def get_into(self, name: str, sink: BinaryIO) -> int:
        return self._call("get", name, lambda: self.inner.get_into(name, sink))

    def size(self, name: str) -> int:  # a read of the object's properties: "get"'s trouble
        return self._call("get", name, lambda: self.inner.size(name))

    def delete(self, name: str) -> None:
        self._call("delete", name, lambda: self.inner.delete(name))

    def list(self, prefix: str = "") -> list[str]:
        return self._call("list", prefix, lambda: self.inner.list(prefix))

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        return self._call("list_modified", prefix, lambda: self.inner.list_modified(prefix))

    def now(self) -> float:
        return self.inner.now()

    def describe(self) -> str:
        return f"{self.inner.describe()} (with injected faults)"

    def bounded(self, deadline: Deadline) -> FaultyStore:
        return FaultyStore(self.inner.bounded(deadline), self.windows, self.log, deadline)


def from_env(inner: ObjectStore) -> FaultyStore:
    """``inner`` behind the windows of ``TRAIN_FAULTY_STORE``, its calls logged to
    ``TRAIN_FAULTY_STORE_LOG`` when set: the ``Wrap`` a worker's ``open_store`` applies."""
    log = os.environ.get(FAULTY_STORE_LOG_ENV)
    return FaultyStore(
        inner, Windows(Path(os.environ[FAULTY_STORE_ENV])), Path(log) if log else None
    )


def faulty_env(control: Path, log: Path | None = None) -> dict[str, str]:
    """The env that puts a started worker's stores behind ``control``'s windows (its calls
    logged to ``log``)."""
    env = {STORE_WRAP_ENV: f"{__name__}:from_env", FAULTY_STORE_ENV: str(control)}
    return env if log is None else env | {FAULTY_STORE_LOG_ENV: str(log)}
