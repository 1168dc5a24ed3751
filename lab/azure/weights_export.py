"""``python -m lab export``: a run's trained model out of its checkpoints, as one plain state dict.

A checkpoint is ``torch.distributed.checkpoint``'s (DCP) files, committed by the run's manifest
(``training/checkpoints/manifest.py``), from a DDP or an fsdp2 run alike. The export reads the
manifest for the checkpoints and their files' sizes and SHA-256, checks every file of the one it
takes (downloaded to local disk from Blob, hashed in place in a directory), then reads the
model's tensors with DCP's own ``FileSystemReader``, one tensor at a time: DCP puts a sharded
tensor back together whatever the world size it was saved at. Each tensor is written into the
output as it comes, so memory holds one tensor, never the model:

- ``.pt``: ``torch.save``'s format through PyTorch's own two-pass recipe (its GPUDirect Storage
  tutorial): ``torch.serialization.skip_data`` writes the file with the space of every storage
  reserved, a load under ``FakeTensorMode`` gives each storage's offset, and the bytes go there;
- ``.safetensors``: the format's header (each tensor's dtype, shape and offsets, known from
  DCP's metadata before any tensor is read), then the tensors' bytes in order.

The keys are the model's own (``hidden.weight``): the checkpoint's prefix is cut, and so is any
wrapper's name (``module.``, ``_orig_mod.``) should one be in it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from training.checkpoints.checkpoint import CheckpointError, CheckpointRepository, Entry
from training.checkpoints.sharded.metadata import decode
from training.checkpoints.sharded.repository import PREFIX
from training.checkpoints.storage import FileStore, ObjectStore
from training.elastic.exit_codes import BAD_INPUT

MODEL_PREFIX = "model.model."
"""DCP's flattened names of the model's tensors in a checkpoint: the ``model`` entry of the
trainer's state, a ``ModelState`` whose own ``model`` is the module's state dict
(``training/checkpoints/sharded/state.py``)."""
WRAPPERS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
"""Names of DDP, ``torch.compile``, FSDP1 and activation checkpointing in a parameter's path."""
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class ExportError(Exception):
    """No checkpoint to export, or one that does not verify; one line."""


def model_name(name: str) -> str:
    """``model.model._orig_mod.hidden.weight`` -> ``hidden.weight``."""
    parts = name.removeprefix(MODEL_PREFIX).split(".")
    return ".".join(p for p in parts if p not in WRAPPERS)


def checkpoints(store: ObjectStore) -> list[Entry]:
    """The sharded checkpoints the run's retained manifests name, newest first."""
    return [e for e in CheckpointRepository(store, prefix=PREFIX).entries() if e.files]


def verified(store: ObjectStore, entry: Entry, scratch: Path) -> tuple[Path, Metadata]:
    """The directory holding ``entry``'s files, each checked against the manifest, and its
    metadata; ExportError naming the first file that is missing or torn."""
    where = store.root if isinstance(store, FileStore) else scratch
    where.mkdir(parents=True, exist_ok=True)
    raw = _checked(store, entry.name, entry.size, entry.sha256, _Hashing(held=True))
    for file in entry.files:
        # A directory's files are hashed where they are; a Blob's land in the scratch folder.
        keep = None if isinstance(store, FileStore) else scratch / file.name
        _checked(store, file.name, file.size, file.sha256, _Hashing(into=keep))
    try:
        return where, decode(raw, entry.name)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None


def _checked(store: ObjectStore, name: str, size: int, digest: str, sink: _Hashing) -> bytes:
    """The object streamed through ``sink``, checked; its bytes if the sink held them."""
    try:
        store.get_into(name, sink)
    except FileNotFoundError:
        raise ExportError(f"{name} is missing from {store.describe()}") from None
    finally:
        sink.close()
    if sink.size != size or sink.digest.hexdigest() != digest:
        raise ExportError(
            f"{name} is torn: {sink.size} bytes with SHA-256 {sink.digest.hexdigest()[:12]}..., "
            f"its manifest says {size} bytes with {digest[:12]}..."
        )
    return bytes(sink.head)


class _Hashing:
    """A sink that hashes what passes, on into the file ``into`` if given; ``held`` keeps the
    bytes too (the metadata: small), else nothing stays in memory but the chunk passing."""

    def __init__(self, into: Path | None = None, held: bool = False) -> None:
        self.file = open(into, "wb") if into else None  # noqa: SIM115 - closed by _checked
        self.digest, self.size, self.head, self.held = hashlib.sha256(), 0, bytearray(), held

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        if self.file:
            self.file.write(data)
        if self.held:
            self.head += data
        return len(data)

    def close(self) -> None:
        if self.file:
            self.file.close()


class _VerifiedReader(FileSystemReader):
    """DCP's reader on the checked files, with the metadata read as data (``decode``), never
    unpickled from the store."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


def model_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The model's tensors in a checkpoint's metadata, by DCP's name, in its order."""
    return {
        name: item
        for name, item in metadata.state_dict_metadata.items()
        if name.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata)
    }


def tensor_reader(path: Path, metadata: Metadata) -> Callable[[str], torch.Tensor]:
    """A function that reads one whole tensor, by DCP's name, from the files in ``path``."""
    reader = _VerifiedReader(path, metadata)
    tensors = model_tensors(metadata)

    def read(name: str) -> torch.Tensor:
        item = tensors[name]
        target = {name: torch.empty(item.size, dtype=item.properties.dtype)}
        with warnings.catch_warnings():  # DCP warns it loads "in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=reader, no_dist=True)
        return target[name]

    return read


def write_pt(out: Path, shapes: Mapping[str, TensorStorageMetadata], read: Callable) -> None:
    """``out`` as ``torch.save`` writes ``{name: tensor}``, one tensor in memory at a time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in shapes.items()}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(fake, out)
    with FakeTensorMode():
        placed = torch.load(out, weights_only=True)
    offsets = {k: placed[k].untyped_storage()._checkpoint_offset for k in shapes}
    with open(out, "r+b") as file:
        for key in shapes:
            file.seek(offsets[key])
            file.write(_raw(read(key)))


def write_safetensors(
    out: Path, shapes: Mapping[str, TensorStorageMetadata], read: Callable
) -> None:
    """``out`` in the safetensors format: its header from the shapes, then each tensor."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, item in shapes.items():
        dtype = item.properties.dtype
        if dtype not in SAFETENSORS_DTYPES:
            raise ExportError(f"{key} is {dtype}, which safetensors has no name for: use .pt")
        size = item.size.numel() * dtype.itemsize
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(item.size),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(out, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for key in shapes:
            file.write(_raw(read(key)))


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, row-major, without a copy when it is contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def export(store: ObjectStore, out: Path, step: int | None, scratch: Path) -> tuple[Entry, int]:
    """Write the model of the newest verified checkpoint (or of ``step``) to ``out``; the entry
    and how many tensors. ExportError when there is none to take."""
    found = checkpoints(store)
    if not found:
        raise ExportError(f"no checkpoint in {store.describe()}")
    if step is not None:
        found = [e for e in found if e.step == step]
        if not found:
            steps = ", ".join(str(e.step) for e in checkpoints(store))
            raise ExportError(
                f"no checkpoint of step {step} in {store.describe()} (there: {steps})"
            )
    problems = []
    for entry in found:
        with _scratch(scratch) as folder:
            try:
                path, metadata = verified(store, entry, folder)
            except ExportError as exc:
                if step is not None:
                    raise ExportError(f"checkpoint of step {step} refused: {exc}") from None
                problems.append(f"step {entry.step}: {exc}")
                print(f"skipped the checkpoint of step {entry.step}: {exc}", file=sys.stderr)
                continue
            tensors = model_tensors(metadata)
            shapes = {model_name(k): v for k, v in tensors.items()}
            if len(shapes) != len(tensors) or not shapes:
                raise ExportError(f"checkpoint of step {entry.step} holds no model to export")
            read = _refusing(tensor_reader(path, metadata), entry, store)
            by_dcp = {model_name(k): k for k in tensors}
            _write_atomically(out, shapes, lambda key, r=read, d=by_dcp: r(d[key]))
            return entry, len(shapes)
    raise ExportError(f"no checkpoint in {store.describe()} verifies ({'; '.join(problems)})")


def _refusing(read: Callable[[str], torch.Tensor], entry: Entry, store: ObjectStore) -> Callable:
    """``read``, a failure of which is an ExportError: a directory's checkpoint is read in
    place after its check, so a run still pruning it (or a disk) can tear it in between."""

    def checked_read(name: str) -> torch.Tensor:
        try:
            return read(name)
        except (CheckpointException, OSError, EOFError, RuntimeError) as exc:
            raise ExportError(
                f"the checkpoint of step {entry.step} in {store.describe()} changed while it "
                f"was read ({type(exc).__name__} reading {model_name(name)}): export again, "
                "or an older one with --step"
            ) from None

    return checked_read


def _write_atomically(out: Path, shapes: Mapping[str, Any], read: Callable) -> None:
    """The file appears under ``out`` only once it is whole."""
    partial = out.with_name(f".{out.name}.partial")
    writer = write_safetensors if out.suffix == ".safetensors" else write_pt
    try:
        writer(partial, shapes, read)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


@contextmanager
def _scratch(folder: Path) -> Iterator[Path]:
    """A new folder inside ``folder`` (``--scratch`` may be a disk of the user's, with files of
    theirs), removed with what it holds; ``folder`` too if this made it."""
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    own = Path(tempfile.mkdtemp(prefix=".lab-export-", dir=folder))
    try:
        yield own
    finally:
        shutil.rmtree(own, ignore_errors=True)
        if made:
            with suppress(OSError):
                folder.rmdir()


def open_checkpoints(uri: str, environ: Mapping[str, str]) -> ObjectStore:
    """The run's checkpoint store: Blob, signed in as the lab's storage commands sign in, or a
    directory that must exist (a typo must not look like a run without checkpoints)."""
    if uri.startswith(("https://", "http://")):
        from lab.azure.clients import storage_credential
        from training.checkpoints.blob_store import BlobStore, parse_blob_uri

        return BlobStore(parse_blob_uri(uri), storage_credential(uri, environ))
    if not Path(uri).is_dir():
        raise ExportError(f"--checkpoint-uri {uri} is not a directory")
    return FileStore(uri)


def main(args: Any, environ: Mapping[str, str]) -> int:
    """``lab export``, its flags parsed; the exit status."""
    from lab.azure.stack_outputs import checkpoint_uri, stack_uri, storage_exit

    if args.out.suffix not in (".pt", ".safetensors"):
        print(f"error: --out {args.out} must end in .pt or .safetensors", file=sys.stderr)
        return BAD_INPUT

    def run() -> None:
        store = open_checkpoints(
            stack_uri(args.checkpoint_uri, args.stack, checkpoint_uri), environ
        )
        scratch = args.scratch or args.out.parent / f".{args.out.name}.scratch"
        entry, count = export(store, args.out, args.step, scratch)
        size = args.out.stat().st_size / 1e6
        print(f"wrote {args.out}: the model of step {entry.step} ({count} tensors, {size:.1f} MB)")

    return storage_exit(run, bad_input=(ExportError,))
