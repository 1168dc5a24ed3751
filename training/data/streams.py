"""A stream of JSON-lines shards named by a manifest: a corpus read in order, never hashed.

``manifest.json`` in the data directory names the stream and its version (its identity: a
state is never resumed over another version) and lists the shards in order::

    {"name": "points", "version": "2026-11-01", "shards": ["part-000.jsonl", "part-001.jsonl"]}

Each line of a shard is one item (any JSON value). ``read(start)`` skips whole shards by
their line counts in the manifest when it has them (``"counts": [1000, 1000]``), and lines
otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class JsonLinesStream:
    """The shards of one manifest, read in order (a ``training.api.Stream``)."""

    root: Path
    name: str
    version: str
    shards: tuple[str, ...]
    counts: tuple[int, ...] | None = None

    @property
    def identity(self) -> str:
        return f"{self.name}@{self.version}"

    def read(self, start: int) -> Iterator[Any]:
        position = 0
        for index, shard in enumerate(self.shards):
            if self.counts is not None and position + self.counts[index] <= start:
                position += self.counts[index]  # the whole shard lies before start
                continue
            with (self.root / shard).open() as lines:
                for line in lines:
                    if position >= start:
                        yield json.loads(line)
                    position += 1


def open_stream(data_dir: str | Path) -> JsonLinesStream:
    """The stream ``data_dir/manifest.json`` names; OSError or ValueError naming the file and
    what is wrong (the loop turns either into one line naming ``--data-dir``)."""
    root = Path(data_dir)
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: a stream needs its manifest") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or not {"name", "version", "shards"} <= manifest.keys():
        raise ValueError(f"{path} must hold name, version and shards")
    shards = tuple(str(s) for s in manifest["shards"])
    for shard in shards:
        if not (root / shard).is_file():
            raise FileNotFoundError(f"{root / shard}: a shard {MANIFEST} lists does not exist")
    counts = manifest.get("counts")
    if counts is not None and len(counts) != len(shards):
        raise ValueError(f"{path}: counts must have one entry per shard")
    return JsonLinesStream(
        root,
        str(manifest["name"]),
        str(manifest["version"]),
        shards,
        None if counts is None else tuple(int(c) for c in counts),
    )


def write_stream(
    data_dir: str | Path, name: str, version: str, shards: list[list[Any]]
) -> JsonLinesStream:
    """Write ``shards`` (lists of items) and their manifest; the stream that reads them."""
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    names = [f"part-{i:03d}.jsonl" for i in range(len(shards))]
    for file, items in zip(names, shards, strict=True):
        (root / file).write_text("".join(json.dumps(item) + "\n" for item in items))
    manifest = {
        "name": name,
        "version": version,
        "shards": names,
        "counts": [len(items) for items in shards],
    }
    (root / MANIFEST).write_text(json.dumps(manifest))
    return open_stream(root)
