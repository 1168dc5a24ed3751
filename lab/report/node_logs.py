"""Reading the training program's JSON lines from the nodes' log files.

Every node writes its workers' stdout to ``<node>.jsonl``: one JSON object per line with
``ts``, ``kind`` ("metrics" | "event"), ``rank``, ``restart_count`` and ``run_id``. Other
lines (a stray print, a line cut off by SIGKILL) are skipped, never fatal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

Record = dict[str, Any]
RECORD_KINDS = ("metrics", "event")


def parse_record(line: str, node: str) -> Record | None:
    """The record on ``line`` tagged with the node that wrote it, or None if it is not one."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or record.get("kind") not in RECORD_KINDS:
        return None
    if not isinstance(record.get("ts"), int | float):
        return None
    return {**record, "node": node}


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
    records: list[Record] = []
    for path in sorted(log_dir.glob("*.jsonl")):
        node = node_name(path)
        for line in path.read_text(errors="replace").splitlines():
            record = parse_record(line, node)
            if record is not None:
                records.append(record)
    return sorted(records, key=lambda r: r["ts"])


def read_jsonl(path: Path) -> list[Record]:
    """All JSON objects in a JSON-lines file (the lab's own event log)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite_number(value: Any) -> bool:
    """A finite JSON number (a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
