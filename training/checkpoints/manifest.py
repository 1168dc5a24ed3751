"""The checkpoint store's records: object and manifest names, manifests, a loaded checkpoint.

Everything here is a pure function of bytes and names; ``training/checkpoints/checkpoint.py`` does
the I/O. A manifest read from a store is data from outside this process (another version, a torn or
hand-edited object), so decoding validates every field and turns anything unexpected into
"not a manifest" (None), never into an exception or a half-valid entry.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

_OBJECT = re.compile(r"^(?P<prefix>[a-z]+)-(?P<step>\d{10})-[0-9a-f]{8}\.pt$")
_MANIFEST = re.compile(r"^(?P<prefix>[a-z]+)-manifest-(?P<seq>\d{10})\.json$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_FIELDS = frozenset({"name", "step", "sha256", "size"})


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no valid one could be read."""


class StaleCheckpoint(CheckpointError):
    """A commit refused because a newer step is already committed: nothing failed."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def object_name(prefix: str, step: int) -> str:
    """A new, unique name for a checkpoint of ``step``: objects are never overwritten."""
    return f"{prefix}-{step:010d}-{uuid.uuid4().hex[:8]}.pt"


def manifest_name(prefix: str, seq: int) -> str:
    return f"{prefix}-manifest-{seq:010d}.json"


def manifest_seq(name: str, prefix: str) -> int | None:
    """The sequence number of a manifest of ``prefix``; None for any other name."""
    match = _MANIFEST.match(name)
    return int(match["seq"]) if match and match["prefix"] == prefix else None


def is_object_of(name: str, prefix: str) -> bool:
    """Whether ``name`` is a checkpoint object of ``prefix``."""
    match = _OBJECT.match(name)
    return bool(match) and match["prefix"] == prefix


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint, as its manifest names it."""

    name: str
    step: int
    sha256: str
    size: int

    @staticmethod
    def from_json(value: Any) -> Entry:
        """The entry a manifest holds; ValueError names what is wrong with it.

        The name is what the store is asked for, so it must be one this program writes
        (``<prefix>-<step>-<nonce>.pt``, no path separators) and carry the entry's own step.
        """
        if not isinstance(value, dict) or set(value) != _ENTRY_FIELDS:
            raise ValueError(f"entry {value!r} does not have exactly {sorted(_ENTRY_FIELDS)}")
        name, step, digest, size = value["name"], value["step"], value["sha256"], value["size"]
        if not _is_int(step) or not 0 <= step < 10**10:
            raise ValueError(f"entry step {step!r} is not an integer in [0, 10^10)")
        match = _OBJECT.match(name) if isinstance(name, str) else None
        if match is None or int(match["step"]) != step:
            raise ValueError(f"entry name {name!r} is not a checkpoint object of step {step}")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise ValueError(f"entry sha256 {digest!r} is not 64 lowercase hex digits")
        if not _is_int(size) or size < 0:
            raise ValueError(f"entry size {size!r} is not an integer >= 0")
        return Entry(name, step, digest, size)

    @property
    def prefix(self) -> str:
        return self.name.split("-", 1)[0]


@dataclass(frozen=True)
class Manifest:
    seq: int
    entries: tuple[Entry, ...]
    """Newest first."""
    writer: str = field(default="", compare=False)
    """Which repository wrote it: for logs when a race is lost."""

    def foreign(self, prefix: str) -> bool:
        """Whether it names objects of another prefix (never ours to read or keep)."""
        return any(e.prefix != prefix for e in self.entries)

    def encode(self) -> bytes:
        body = {
            "seq": self.seq,
            "entries": [asdict(e) for e in self.entries],
            "writer": self.writer,
        }
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": body, "sha256": sha256(text.encode())}).encode()

    @staticmethod
    def decode(data: bytes) -> Manifest | None:
        """The manifest, or None when it is torn, not ours, or names anything invalid."""
        try:
            outer = json.loads(data)
            body = outer["body"]
            if sha256(json.dumps(body, sort_keys=True).encode()) != outer["sha256"]:
                return None
            return Manifest._from_body(body)
        except (ValueError, KeyError, TypeError):  # JSON, a missing field, a wrong shape
            return None

    @staticmethod
    def _from_body(body: Any) -> Manifest:
        seq, raw, writer = body["seq"], body["entries"], body.get("writer", "")
        if not _is_int(seq) or seq < 1 or not isinstance(raw, list) or not isinstance(writer, str):
            raise ValueError(f"manifest fields seq={seq!r}, writer={writer!r} are invalid")
        entries = tuple(Entry.from_json(e) for e in raw)
        steps = [e.step for e in entries]
        if steps != sorted(steps, reverse=True) or len({e.name for e in entries}) != len(steps):
            raise ValueError("manifest entries are not distinct and newest first")
        if len({e.prefix for e in entries}) > 1:
            raise ValueError("manifest entries belong to more than one prefix")
        return Manifest(seq, entries, writer)


@dataclass(frozen=True)
class Loaded:
    """A checkpoint as a reader loaded it: its entry and bytes."""

    entry: Entry
    data: bytes
    state: dict[str, Any] | None = None
    """The state in ``data``, when the reader parsed it (``load_latest(parse=True)``)."""
