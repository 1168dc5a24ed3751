"""The checkpoint store's records: object and manifest names, manifests, a loaded checkpoint.

Everything here is a pure function of bytes and names; ``training/checkpoints/checkpoint.py`` does
the I/O. A checkpoint is one object (``<prefix>-<step>-<nonce>.pt``, a single file), or a
sharded one (``training/checkpoints/sharded/``): its ``.metadata`` object is the entry, and the
entry lists the ranks' files (``<prefix>-<step>-<nonce>.<rank>-<k>.distcp``), each with its size
and SHA-256, so a manifest commits every object of the checkpoint at once. A rank that saved its
part alone (an emergency) wrote a record of it too (``<prefix>-<step>-<nonce>.<rank>.part``).
A manifest read from a store is data from outside this process (another version, a torn or
hand-edited object), so decoding validates every field and turns anything unexpected into "not
a manifest" (None), never into an exception or a half-valid entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

_OBJECT = re.compile(
    r"^(?P<id>(?P<prefix>[a-z]+)-(?P<step>\d{10})-[0-9a-f]{8})"
    r"(?P<kind>\.pt|\.metadata|\.\d{1,6}-\d{1,6}\.distcp|\.\d{1,6}\.part)$"
)
_HEADS = (".pt", ".metadata")
"""What an entry may name: a single-file checkpoint, or a sharded one's metadata."""
_MANIFEST = re.compile(r"^(?P<prefix>[a-z]+)-manifest-(?P<seq>\d{10})\.json$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_FIELDS = frozenset({"name", "step", "sha256", "size"})
_OPTIONAL_FIELDS = frozenset({"files", "fence"})
ROUND_FILE_ENV = "TRAIN_RDZV_ROUND_FILE"
"""The file the agent writes its round to (training/elastic/launch.py, ``ROUND_FILE_ENV``):
read once, when a worker starts, as its group's fencing token."""
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
_FILE_FIELDS = frozenset({"name", "sha256", "size"})


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no valid one could be read."""


class StaleCheckpoint(CheckpointError):
    """A commit refused because a newer step is already committed, or the head comes from a
    newer rendezvous round of the run (``Fence``): nothing failed."""


@dataclass(frozen=True)
class Fence:
    """The fencing token of a commit: the run and the rendezvous round its writer's group
    formed in. A commit from an older round of the same run than the head's is refused, so a
    group the run has left (cut off from etcd, its self-fence late) can never publish once the
    group that replaced it has. Round 0: not known (a run without the rendezvous's round
    file); another run's head fences nothing (a new run of the job starts at round 1)."""

    run: str = ""
    round: int = 0

    @staticmethod
    def of_process(env: dict[str, str] | None = None) -> Fence:
        """This process's fence, from the agent's round file and torch's run id."""
        env = dict(os.environ) if env is None else env
        path = env.get(ROUND_FILE_ENV, "")
        try:
            with open(path) as f:
                round_ = int(json.load(f)["round"]) if path else 0
        except (OSError, ValueError, KeyError, TypeError):
            round_ = 0
        return Fence(env.get(RUN_ID_ENV, ""), round_)

    def older_than(self, head: Fence) -> bool:
        return bool(self.run) and self.run == head.run and self.round < head.round

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "round": self.round}

    @staticmethod
    def from_json(value: Any) -> Fence:
        if (
            not isinstance(value, dict)
            or set(value) != {"run", "round"}
            or not isinstance(value["run"], str)
            or not _is_int(value["round"])
            or value["round"] < 0
        ):
            raise ValueError(f"fence {value!r} is not {{run: str, round: int >= 0}}")
        return Fence(value["run"], value["round"])


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
    """Whether ``name`` is a checkpoint object of ``prefix`` (a file of a sharded one too)."""
    match = _OBJECT.match(name)
    return bool(match) and match["prefix"] == prefix


def object_step(name: str, prefix: str) -> int | None:
    """The step of a checkpoint object of ``prefix`` (a file or a part's record); None for
    any other name."""
    match = _OBJECT.match(name)
    return int(match["step"]) if match and match["prefix"] == prefix else None


def unreferenced(
    old: set[str], manifests: list[Manifest], top: int, prefix: str, retained: int
) -> list[str]:
    """Which of the ``old`` objects a durable prune deletes (``checkpoint.py`` says why that is
    safe): ours, named by none of ``manifests`` (the newest ``retained`` valid ones, newest
    first), and a checkpoint's object or a manifest no newer than the retired ones; nothing
    when no manifest is valid (then nothing would be left to repair by hand)."""
    if not manifests:
        return []
    named = {name for m in manifests for e in m.entries for name in e.objects}
    newest_retired = min(top - retained, min(m.seq for m in manifests) - 1)
    doomed = []
    for name in sorted(old - named):
        seq = manifest_seq(name, prefix)
        if is_object_of(name, prefix) or (seq is not None and seq <= newest_retired):
            doomed.append(name)
    return doomed


def sharded_id(prefix: str, step: int) -> str:
    """A new, unique id for a sharded checkpoint of ``step``; its objects all start with it."""
    return object_name(prefix, step).removesuffix(".pt")


def metadata_name(checkpoint_id: str) -> str:
    """The object that holds a sharded checkpoint's DCP metadata: the manifest's entry."""
    return f"{checkpoint_id}.metadata"


def shard_name(checkpoint_id: str, rank: int, index: int) -> str:
    """The ``index``-th file rank ``rank`` writes for a sharded checkpoint."""
    return f"{checkpoint_id}.{rank}-{index}.distcp"


def part_name(checkpoint_id: str, rank: int) -> str:
    """The record of the part rank ``rank`` saved alone (``sharded/parts.py``)."""
    return f"{checkpoint_id}.{rank}.part"


def parse_part(name: str, prefix: str) -> tuple[str, int, int] | None:
    """(checkpoint id, step, rank) of a part's record of ``prefix``, or None."""
    match = _OBJECT.match(name)
    if not match or match["prefix"] != prefix or not match["kind"].endswith(".part"):
        return None
    return match["id"], int(match["step"]), int(match["kind"].split(".")[1])


def _checkpoint_id(name: str) -> str | None:
    match = _OBJECT.match(name)
    return match["id"] if match else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_digest_and_size(digest: Any, size: Any) -> None:
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise ValueError(f"sha256 {digest!r} is not 64 lowercase hex digits")
    if not _is_int(size) or size < 0:
        raise ValueError(f"size {size!r} is not an integer >= 0")


@dataclass(frozen=True)
class StoredFile:
    """One file of a sharded checkpoint: its object, and what its bytes must be."""

    name: str
    size: int
    sha256: str

    @staticmethod
    def from_json(value: Any, checkpoint_id: str) -> StoredFile:
        """A file an entry lists; ValueError unless it is a shard file of ``checkpoint_id``."""
        if not isinstance(value, dict) or set(value) != _FILE_FIELDS:
            raise ValueError(f"file {value!r} does not have exactly {sorted(_FILE_FIELDS)}")
        name = value["name"]
        match = _OBJECT.match(name) if isinstance(name, str) else None
        if match is None or match["id"] != checkpoint_id or not name.endswith(".distcp"):
            raise ValueError(f"file name {name!r} is not a shard of {checkpoint_id}")
        _check_digest_and_size(value["sha256"], value["size"])
        return StoredFile(name, value["size"], value["sha256"])


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint, as its manifest names it."""

    name: str
    step: int
    sha256: str
    size: int
    files: tuple[StoredFile, ...] = ()
    """A sharded checkpoint's files (``name`` is then its metadata); none for a single file."""
    fence: Fence = Fence()
    """The run and round of the group that committed it (``Fence``)."""

    @staticmethod
    def from_json(value: Any) -> Entry:
        """The entry a manifest holds; ValueError names what is wrong with it.

        The name is what the store is asked for, so it must be one this program writes
        (``<prefix>-<step>-<nonce>.pt``, no path separators) and carry the entry's own step.
        """
        if not isinstance(value, dict) or set(value) - _OPTIONAL_FIELDS != _ENTRY_FIELDS:
            raise ValueError(f"entry {value!r} does not have exactly {sorted(_ENTRY_FIELDS)}")
        name, step, digest, size = value["name"], value["step"], value["sha256"], value["size"]
        if not _is_int(step) or not 0 <= step < 10**10:
            raise ValueError(f"entry step {step!r} is not an integer in [0, 10^10)")
        match = _OBJECT.match(name) if isinstance(name, str) else None
        if match is None or int(match["step"]) != step or match["kind"] not in _HEADS:
            raise ValueError(f"entry name {name!r} is not a checkpoint object of step {step}")
        _check_digest_and_size(digest, size)
        files = value.get("files", [])
        if not isinstance(files, list) or bool(files) != (match["kind"] == ".metadata"):
            raise ValueError(f"entry {name!r}: files {files!r} do not fit its kind")
        listed = tuple(StoredFile.from_json(f, match["id"]) for f in files)
        if len({f.name for f in listed}) != len(listed):
            raise ValueError(f"entry {name!r} lists a file twice")
        fence = Fence.from_json(value["fence"]) if "fence" in value else Fence()
        return Entry(name, step, digest, size, listed, fence)

    @property
    def prefix(self) -> str:
        return self.name.split("-", 1)[0]

    @property
    def objects(self) -> tuple[str, ...]:
        """Every object of this checkpoint: what pruning keeps and a discard deletes."""
        return (self.name, *(f.name for f in self.files))

    @property
    def checkpoint_id(self) -> str:
        """The name every object of this checkpoint starts with."""
        found = _checkpoint_id(self.name)
        assert found is not None, self.name  # validated when built from a manifest
        return found

    def to_json(self) -> dict[str, Any]:
        """As a manifest holds it; a single-file entry without a fence keeps the fields it
        always had."""
        body = {k: v for k, v in asdict(self).items() if k not in _OPTIONAL_FIELDS}
        if self.files:
            body["files"] = [asdict(f) for f in self.files]
        if self.fence != Fence():
            body["fence"] = self.fence.to_json()
        return body


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
            "entries": [e.to_json() for e in self.entries],
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


class LogRead(NamedTuple):
    """The manifest log as one read found it, and when the read began: the highest sequence
    taken, the newest valid manifests, and whether the view was whole (``checkpoint.py``)."""

    read_at: float
    top: int
    manifests: list[Manifest]
    whole: bool


@dataclass(frozen=True)
class Loaded:
    """A checkpoint as a reader loaded it: its entry and bytes."""

    entry: Entry
    data: bytes
    state: dict[str, Any] | None = None
    """The state in ``data``, when the reader parsed it (``NodeLocalState.load``)."""
