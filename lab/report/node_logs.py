"""Reading the training program's JSON lines from the nodes' log files.

Every node writes its workers' stdout to ``<node>.jsonl``: one record per line, as
training/records.py defines and reads them. Other lines (a stray print, a line cut off by
SIGKILL) are skipped, never fatal.
"""

from __future__ import annotations

import json
from pathlib import Path

from training.records import Record, read_log


class LogTail:
    """Complete new lines of a file that is still being written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read_lines(self) -> list[str]:
        """Lines completed since the last call; a trailing partial line waits for its newline."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]


def node_name(path: Path) -> str:
    """``nodes/node-3.jsonl`` -> ``node-3``."""
    return path.name.removesuffix(".jsonl")


def read_records(log_dir: Path) -> list[Record]:
    """Every record in every ``*.jsonl`` under ``log_dir``, ordered by timestamp."""
    found = [r for path in sorted(log_dir.glob("*.jsonl")) for r in read_log(path, node_name(path))]
    return sorted(found, key=lambda r: r["ts"])


def read_jsonl(path: Path) -> list[Record]:
    """All JSON objects in a JSON-lines file (the lab's own event log)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
