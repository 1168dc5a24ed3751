"""The event log of what the lab, ``lab watch`` or ``lab drill`` did, written as it happens.

One JSON object a line, each with its ``ts`` and ``event``: a run's start and end, each fault
injected, each node started. ``lab.report.run_logs`` reads it back next to the training's
records (``lab-events.jsonl``, ``drill-events.jsonl``, ``watch-events.jsonl``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class LabEventLog:
    """The lab's own JSON lines: what it injected and when, which nodes it started."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one record and return it."""
        record = {"ts": round(self.clock(), 3), "event": event, **fields}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return record
