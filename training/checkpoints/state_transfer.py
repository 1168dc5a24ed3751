"""A training state sent from the rank that holds it to every other rank of a group.

The holder sends the state's structure once: a pickle of the tree in which each tensor is only
a reference (its dtype, shape and whether it requires grad); the keys and the other values are
there as they are. Then it sends the tensors' bytes, in order, in broadcasts of at most
``BUCKET_BYTES``: a large tensor in slices of its own memory, small ones packed into one bucket.
A receiver allocates each tensor once and the bytes land in it, so no rank ever holds the state
serialized, and each holds it once (plus a bucket). A receiver that passes its live state
(``into``) allocates nothing for a tensor it already holds at the same path, of the same dtype
and shape: the bytes land in that tensor. Tensors that share memory on the holder (tied
weights) are sent once and arrive as one tensor.

The structure is unpickled with ``pickle``: the ranks of a group run this same program, and the
holder made the tree from a ``weights_only`` load of a checkpoint, so it holds only data.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 1024 * 1024
"""The most one broadcast carries: gloo's cost per call is amortized long before this, and a
bucket of it is noise next to a state of gigabytes."""

Segment = tuple[int, int, int]
"""(tensor index, first byte, end byte) of one piece of a broadcast."""

Path = tuple[Any, ...]
"""The keys (and list positions) that lead from a state's root to one of its values."""


def tensor_paths(state: Any) -> dict[int, tuple[Path, torch.Tensor]]:
    """Each tensor in ``state``'s dicts, lists and tuples, by ``id``: the first path that
    reaches it (a tied tensor's other paths lead to the same one), and the tensor."""
    found: dict[int, tuple[Path, torch.Tensor]] = {}

    def visit(value: Any, path: Path) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), (path, value))
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(item, (*path, key))
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                visit(item, (*path, index))

    visit(state, ())
    return found


class _Describer(pickle.Pickler):
    """Pickles a state tree with each tensor as a reference; collects the tensors in order."""

    def __init__(self, file: io.BytesIO, paths: dict[int, tuple[Path, torch.Tensor]]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.paths: list[Path | None] = []
        """Each sent tensor's path in the state (None: inside some other object)."""
        self._paths = paths
        self._seen: dict[tuple[Any, ...], int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.dtype)
        key += (tuple(obj.shape), obj.stride())
        index = self._seen.get(key) if obj.numel() else None
        if index is None:
            index = len(self.tensors)
            self.tensors.append(obj)
            self.paths.append(self._paths[id(obj)][0] if id(obj) in self._paths else None)
            if obj.numel():
                self._seen[key] = index
        parameter = isinstance(obj, torch.nn.Parameter)
        return ("tensor", index, obj.dtype, tuple(obj.shape), obj.requires_grad, parameter)


class _Builder(pickle.Unpickler):
    """Unpickles a structure, allocating each tensor it references once."""

    def __init__(self, file: io.BytesIO, live: list[torch.Tensor | None]) -> None:
        """``live[i]``: the receiver's own tensor at the path of sent tensor ``i``, if any."""
        super().__init__(file)
        self.tensors: list[torch.Tensor] = []
        self._live = live

    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind, index, dtype, shape, requires_grad, parameter = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown reference {kind!r}")
        if index == len(self.tensors):
            live = self._live[index]
            if live is not None and _fits(live, dtype, shape):
                self.tensors.append(live)  # the bytes land in the receiver's own tensor
                return live
            tensor = torch.empty(shape, dtype=dtype)
            if parameter:
                tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
            else:
                tensor.requires_grad_(requires_grad)
            self.tensors.append(tensor)
        return self.tensors[index]


def _fits(live: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether the sent tensor's bytes can land in ``live`` as they are: same dtype and shape,
    and one contiguous block (a strided tensor's bytes are not a view)."""
    return live.dtype == dtype and tuple(live.shape) == shape and live.is_contiguous()


def describe(state: dict[str, Any]) -> tuple[bytes, list[torch.Tensor]]:
    """The holder's side: (the structure to send, the tensors it references, in order). The
    structure holds the tree, each tensor a reference, and each tensor's path in it."""
    buffer = io.BytesIO()
    describer = _Describer(buffer, tensor_paths(state))
    describer.dump(state)
    structure = pickle.dumps((describer.paths, buffer.getvalue()), pickle.HIGHEST_PROTOCOL)
    return structure, describer.tensors


def plan(sizes: list[int], bucket: int | None = None) -> list[list[Segment]]:
    """The broadcasts that carry tensors of ``sizes`` bytes, in order, each at most ``bucket``
    (``BUCKET_BYTES``) bytes: a tensor of a bucket or more alone, in slices; smaller ones
    packed together."""
    bucket = bucket or BUCKET_BYTES
    chunks: list[list[Segment]] = []
    current: list[Segment] = []
    filled = 0
    for index, size in enumerate(sizes):
        if size >= bucket:
            if current:
                chunks.append(current)
                current, filled = [], 0
            chunks.extend(
                [(index, start, min(size, start + bucket))] for start in range(0, size, bucket)
            )
        elif size:
            if filled + size > bucket:
                chunks.append(current)
                current, filled = [], 0
            current.append((index, 0, size))
            filled += size
    if current:
        chunks.append(current)
    return chunks


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor: a view when it is contiguous, else a copy."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def share(
    state: dict[str, Any] | None,
    src: int,
    device: torch.device,
    group: Any,
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every rank of ``group`` calls this together: the holder, global rank ``src``, with its
    ``state``, the others with None; all return the holder's state (the holder its own).

    ``into``: a receiver's live state. Its tensors that fit are filled in place and returned
    in the state, so loading that state copies nothing (the holder ignores it)."""
    size = torch.zeros(1, dtype=torch.int64)
    if state is None:
        _broadcast(size, src, device, group, received=True)
        return _receive(int(size), src, device, group, into)
    structure, tensors = describe(state)
    size[0] = len(structure)
    _broadcast(size, src, device, group)
    _send(structure, tensors, src, device, group)
    return state


def _send(
    structure: bytes, tensors: list[torch.Tensor], src: int, device: torch.device, group: Any
) -> None:
    _broadcast(torch.frombuffer(bytearray(structure), dtype=torch.uint8), src, device, group)
    views: dict[int, torch.Tensor] = {}
    for chunk in plan([t.numel() * t.element_size() for t in tensors]):
        pieces = []
        for index, start, end in chunk:
            if index not in views:  # one view (or copy) per tensor, dropped after its last slice
                views.clear()
                views[index] = _bytes(tensors[index])
            pieces.append(views[index][start:end])
        _broadcast(pieces[0] if len(pieces) == 1 else torch.cat(pieces), src, device, group)


def _receive(
    size: int, src: int, device: torch.device, group: Any, into: dict[str, Any] | None
) -> dict[str, Any]:
    """The state ``_send`` sends: its structure is ``size`` bytes."""
    structure = torch.empty(size, dtype=torch.uint8)
    _broadcast(structure, src, device, group, received=True)
    paths, tree = pickle.loads(structure.numpy().tobytes())
    mine = {path: tensor for path, tensor in tensor_paths(into).values()}
    builder = _Builder(io.BytesIO(tree), [mine.get(path) for path in paths])
    state = builder.load()
    targets = [_bytes(t) for t in builder.tensors]  # views: contiguous, new or the receiver's
    for chunk in plan([t.numel() for t in targets]):
        if len(chunk) == 1 and targets[chunk[0][0]].device.type == "cpu":
            index, start, end = chunk[0]
            _broadcast(targets[index][start:end], src, device, group, received=True)
            continue
        bucket = torch.empty(sum(end - start for _, start, end in chunk), dtype=torch.uint8)
        _broadcast(bucket, src, device, group, received=True)
        offset = 0
        for index, start, end in chunk:
            targets[index][start:end].copy_(bucket[offset : offset + end - start])
            offset += end - start
    return state


def _broadcast(
    tensor: torch.Tensor, src: int, device: torch.device, group: Any, received: bool = False
) -> None:
    """Broadcast a CPU tensor through ``device`` (a NCCL group's tensors are on the GPU)."""
    if device.type == "cpu":
        dist.broadcast(tensor, src=src, group=group)
        return
    moved = tensor.to(device)
    dist.broadcast(moved, src=src, group=group)
    if received:
        tensor.copy_(moved.cpu())
