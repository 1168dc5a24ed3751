"""Answers of Azure's read APIs, kept for a while in the user's cache dir.

Prices change at most daily and eviction bands hourly, so a second ``lab prices`` within
that time answers from disk, in well under a second, and works offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

APP = "spot-lab"


def cache_dir(environ: dict[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/spot-lab``, else ``~/.cache/spot-lab``."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / APP


class ApiCache:
    """A JSON value per key, trusted for ``ttl_s`` after it was written."""

    def __init__(self, directory: Path, *, refresh: bool = False) -> None:
        self.directory = directory
        self.refresh = refresh
        """True: ignore what is stored (still store the new answers)."""
        self.hits = 0

    def _path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def get(self, key: str, ttl_s: float) -> Any | None:
        if self.refresh:
            return None
        path = self._path(key)
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # absent or torn: ask the API again
        if entry.get("key") != key or time.time() - entry.get("at", 0) > ttl_s:
            return None
        self.hits += 1
        return entry["value"]

    def put(self, key: str, value: Any) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self._path(key)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "at": time.time(), "value": value}))
            tmp.replace(path)  # a reader sees the old answer or the new one, never half
        except OSError:
            pass  # a read-only home only costs the next run an API call

    def fetch(self, key: str, ttl_s: float, load: Callable[[], Any]) -> Any:
        """The stored answer for ``key`` if fresh, else ``load()``'s, stored."""
        value = self.get(key, ttl_s)
        if value is None:
            value = load()
            self.put(key, value)
        return value
