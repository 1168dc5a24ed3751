"""Structured JSON lines on stdout (metrics and events), readable logs on stderr; the same lines
to a sink too (``run_records.py``: the run's storage), when one is given."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from training import records
from training.loop.dist import DistEnv

if TYPE_CHECKING:
    from training.checkpoints.deadline import Deadline


def setup_logging(env: DistEnv, level: int = logging.INFO) -> None:
    """Readable logs on stderr, each line tagged with the worker's rank."""
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


class RecordSink(Protocol):
    """Where the lines go besides the stream: each call is cheap (it runs at every step)."""

    def write(self, line: str) -> None:
        """One record, a JSON object without its newline."""

    def close(self, deadline: Deadline | None = None) -> None:
        """Keep what was written, before ``deadline`` if given; no more lines come."""


class EventLog:
    """One JSON object per line, each a record of training/records.py."""

    def __init__(
        self,
        env: DistEnv,
        stream: IO[str] | None = None,
        agent: bool = False,
        sink: RecordSink | None = None,
    ) -> None:
        """``agent``: the lines of a node's agent, not of a worker (their ``rank`` is null).
        ``sink``: where every line goes too."""
        self.env = env
        self.stream = stream or sys.stdout
        self.sink = sink
        rank = None if agent else env.rank
        self._base = {"rank": rank, "restart_count": env.restart_count, "run_id": env.run_id}
        if env.rdzv_round:  # which group a line comes from: two groups at once is split brain
            self._base["rdzv_round"] = env.rdzv_round

    def _write(self, record: dict[str, Any]) -> None:
        full = {"ts": round(time.time(), 3), **self._base, **record}
        records.check(full)  # a field no reader knows fails here, in the writer's tests
        line = json.dumps(full)
        self.stream.write(line + "\n")
        self.stream.flush()
        if self.sink is not None:
            self.sink.write(line)

    def close(self, deadline: Deadline | None = None) -> None:
        """Hand the sink what it holds, before ``deadline`` if given (the stream is not ours
        to close)."""
        if self.sink is not None:
            self.sink.close(deadline)

    def metrics(self, **fields: Any) -> None:
        self._write({"kind": records.METRICS, **fields})

    def event(self, name: str, /, **fields: Any) -> None:
        """One of the events of training/records.py, with its fields."""
        self._write({"kind": records.EVENT, "event": name, **fields})


def progress_line(
    step: int, max_steps: int, epoch: int, world: int, loss: float, rate: float
) -> str:
    """What a human reads: ``step 120/1000 (12%) | epoch 3 | world 3 | loss 1.2345 | ...``."""
    pct = 100.0 * step / max_steps
    return (
        f"step {step}/{max_steps} ({pct:.0f}%) | epoch {epoch} | world {world} | "
        f"loss {loss:.4f} | {rate:.0f} samples/s"
    )


def seconds_since_process_start() -> float:
    """How long ago this process was spawned (Linux /proc), so interpreter and imports count."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


class Phases:
    """Named durations of a worker's start-up, for the profile of a recovery."""

    def __init__(self) -> None:
        self.durations: dict[str, float] = {
            "spawn_and_import_s": round(seconds_since_process_start(), 4)
        }
        # True when the launcher forked this worker with torch's heavy imports already done.
        self.warm = "torch._dynamo" in sys.modules
        self._last = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.durations[f"{name}_s"] = round(now - self._last, 4)
        self._last = now

    def total(self) -> float:
        return round(sum(self.durations.values()), 4)
