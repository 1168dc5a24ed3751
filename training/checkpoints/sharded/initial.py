"""A sharded model's weights from another run's checkpoint (``--init-from``), each rank holding
in memory only its own shards, never the whole model.

- **A sharded checkpoint** (DCP): ``dcp.load`` of the model's entries alone into this model's
  DTensors, resharded from the world it was saved at (``ShardedCheckpoints.load``: each rank
  downloads and verifies only the files its shards read).
- **A single-file checkpoint** (a DDP run's): every rank downloads the file, verifies its
  SHA-256 as it streams, and maps it (``load_mapped``: pages are read as they are used). Each
  parameter's slice that is this rank's shard is copied from the mapping into the shard, one
  tensor at a time, so no rank ever holds more than one slice of the source.

Both raise ``DoesNotFit`` when the source's model is not this one's (names, shapes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from training.checkpoints.checkpoint import CheckpointError, CheckpointRepository, Entry
from training.checkpoints.node_prune import scratch_folder
from training.checkpoints.serialization import load_mapped
from training.checkpoints.sharded.reader import fetch_verified
from training.checkpoints.sharded.repository import (
    DoesNotFitState,
    ShardedCheckpoints,
    coordinator_decides,
)
from training.checkpoints.storage import ObjectStore

logger = logging.getLogger(__name__)

MODEL_KEY = "model"
"""Where a checkpoint keeps the model: the single file's ``state["model"]``, and the sharded
one's ``ModelState`` under ``model`` with the weights under its own ``model``."""


class DoesNotFit(ValueError):
    """The source's model is not this one's: the message names the first difference."""


def load_sharded_source(
    store: ObjectStore, scratch: Path, model: nn.Module, group: Any
) -> Entry | None:
    """The newest sharded checkpoint in ``store`` that verifies, its model only, into
    ``model``'s shards; its entry, or None when none verifies. Every rank calls this."""
    weights = get_model_state_dict(model)  # the DTensors DCP loads into, in place
    wanted = {MODEL_KEY: {MODEL_KEY: weights}}
    try:
        entry = ShardedCheckpoints(store, scratch).load(wanted, group=group)
    except DoesNotFitState as exc:
        raise DoesNotFit(exc.detail) from None
    if entry is not None:
        set_model_state_dict(model, weights)
    return entry


def load_file_source(
    store: ObjectStore, scratch: Path, model: nn.Module, group: Any
) -> Entry | None:
    """The newest single-file checkpoint in ``store`` whose bytes verify on every rank, its
    model's tensors copied into ``model``'s shards; its entry, or None. Every rank calls
    this; all try the coordinator's entries in the same order and agree on each."""
    for entry in coordinator_decides(CheckpointRepository(store).entries, group):
        with scratch_folder(scratch, ".init-") as folder:
            path = folder / "state"
            try:
                problem = fetch_verified(store, entry, path)
            except OSError as exc:
                problem = f"cannot be read: {exc}"
            if problem is not None:
                logger.warning("checkpoint %s %s; trying an older one", entry.name, problem)
            every = torch.tensor([int(problem is None)])
            dist.all_reduce(every, op=dist.ReduceOp.MIN, group=group)
            if not every.item():
                continue  # torn or gone on some rank: the previous one, everywhere
            state = load_mapped(path)
            if not isinstance(state.get(MODEL_KEY), dict):
                raise CheckpointError(f"checkpoint {entry.name} holds no model")
            copy_into_shards(state[MODEL_KEY], model)
            return entry
    return None


def copy_into_shards(source: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Each of ``model``'s entries (``state_dict`` names; a tied weight once) from the whole
    tensor of that name in ``source``: this rank's slice of it, one tensor at a time."""
    targets = model.state_dict()
    missing = sorted(set(targets) - set(source))
    unexpected = sorted(set(source) - set(targets))
    if missing or unexpected:
        raise DoesNotFit(f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    done: set[int] = set()
    with torch.no_grad():
        for name, target in targets.items():
            whole = source[name]
            if tuple(whole.shape) != tuple(target.shape):
                raise DoesNotFit(
                    f"size mismatch for {name}: {tuple(whole.shape)} in the checkpoint, "
                    f"{tuple(target.shape)} in this model"
                )
            if id(target) in done:
                continue
            done.add(id(target))
            if not isinstance(target, DTensor):
                target.copy_(whole)
                continue
            shape, offset = compute_local_shape_and_global_offset(
                target.shape, target.device_mesh, target.placements
            )
            mine = whole[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
            target.to_local().copy_(mine)  # reads this slice's pages of the mapping only
