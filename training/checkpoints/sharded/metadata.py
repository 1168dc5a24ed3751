"""DCP's metadata as bytes, read back as data: never code from the store.

DCP pickles its ``Metadata`` (torch 2.13 ``filesystem.py``, ``_FileSystemWriter.finish``) and
its own reader unpickles it with plain ``pickle.load``. A checkpoint on shared storage is data,
so this reader resolves only the classes DCP's metadata is made of; anything else fails the
read (the checkpoint is then passed over like a torn one).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from training.checkpoints.manifest import CheckpointError

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name
    "torch": frozenset({"Size"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint's metadata")


def encode(metadata: Metadata) -> bytes:
    return pickle.dumps(metadata)


def decode(data: bytes, name: str) -> Metadata:
    """The metadata in ``data`` (the object ``name``); CheckpointError when it is not one."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # whatever the bytes are, they are no metadata this reads
        raise CheckpointError(f"{name} is not DCP metadata this program reads: {exc}") from exc
    if not isinstance(metadata, Metadata) or metadata.storage_data is None:
        raise CheckpointError(f"{name} is not DCP metadata this program reads")
    return metadata
