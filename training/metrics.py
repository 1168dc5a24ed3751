"""Structured JSON lines on stdout (metrics and events), readable logs on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

from training.dist import DistEnv


def setup_logging(env: DistEnv, level: int = logging.INFO) -> None:
    """Readable logs on stderr, each line tagged with the worker's rank."""
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


class EventLog:
    """One JSON object per line: ``kind`` is "metrics" or "event"."""

    def __init__(self, env: DistEnv, stream: IO[str] | None = None) -> None:
        self.env = env
        self.stream = stream or sys.stdout
        self._base = {"rank": env.rank, "restart_count": env.restart_count, "run_id": env.run_id}

    def _write(self, record: dict[str, Any]) -> None:
        self.stream.write(json.dumps({"ts": round(time.time(), 3), **self._base, **record}) + "\n")
        self.stream.flush()

    def metrics(self, **fields: Any) -> None:
        self._write({"kind": "metrics", **fields})

    def event(self, name: str, /, **fields: Any) -> None:
        self._write({"kind": "event", "event": name, **fields})


def progress_line(
    step: int, max_steps: int, epoch: int, world: int, loss: float, rate: float
) -> str:
    """What a human reads: ``step 120/1000 (12%) | epoch 3 | world 3 | loss 1.2345 | ...``."""
    pct = 100.0 * step / max_steps
    return (
        f"step {step}/{max_steps} ({pct:.0f}%) | epoch {epoch} | world {world} | "
        f"loss {loss:.4f} | {rate:.0f} samples/s"
    )
