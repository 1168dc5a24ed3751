"""One world of ranks saving and restoring a sharded checkpoint, each measuring its own peak RSS.

Each rank builds the model (FSDP2: ``fully_shard`` per layer, or DDP: a whole replica) and
trains one step so the optimizer holds its state, then saves through ``ShardedCheckpoints`` to
a directory store. New processes build the model again (another seed) and load the checkpoint
into it. Before each, the kernel's high-water mark of the process's RSS is reset
(``/proc/self/clear_refs``, 5); read back after (``VmHWM``), it is the peak during the save or
the load. On the CPU with gloo.
"""

from __future__ import annotations

import gc
import json
import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import ModelState, TrainerState, training_state
from training.checkpoints.storage import FileStore

LAYERS = 4
MIB = 1024 * 1024


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _reset_peak() -> int:
    """Reset the high-water mark to the current RSS; that RSS, in bytes."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _rss_kib("VmRSS") * 1024


def _peak() -> int:
    return _rss_kib("VmHWM") * 1024


def _build(mode: str, state_mib: int, world: int, seed: int) -> tuple[Any, Any]:
    """A model whose parameters are a third of ``state_mib`` (AdamW keeps two more), wrapped,
    with its optimizer after one step."""
    width = int(math.sqrt(state_mib * MIB / 3 / LAYERS / 4))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)))
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    wrapped(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return wrapped, optimizer


def _local_bytes(model: Any, optimizer: Any) -> int:
    """What this rank holds of the state: its shards (FSDP2) or the whole replica (DDP)."""
    tensors = [*model.parameters()]
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def _rank(rank: int, world: int, mode: str, state_mib: int, root: str, phase: str) -> None:
    base = Path(root)
    store = dist.FileStore(str(base / f"init-{phase}"), world)
    store.set_timeout(timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        runtime = _reset_peak()  # torch, gloo and this program, before any state
        checkpoints = ShardedCheckpoints(FileStore(base / "store"), base / f"scratch-{rank}")
        model, optimizer = _build(mode, state_mib, world, seed=0 if phase == "save" else 1)
        trainer = TrainerState(step=1 if phase == "save" else 0)
        state = training_state(ModelState(model, optimizer), trainer)
        before = _reset_peak()
        if phase == "save":
            checkpoints.save(state, 1)
        else:
            entry = checkpoints.load(state)
            assert entry is not None and trainer.step == 1
        row = {
            "rank": rank,
            "share": _local_bytes(model, optimizer),
            "runtime": runtime,
            "before": before,
            "peak": _peak(),
        }
        (base / f"{phase}-{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()


def measure(mode: str, state_mib: int, world: int, root: Path) -> dict[str, list[dict[str, int]]]:
    """For the save and for the restore (each in processes of its own), each rank's row: its
    share of the state, its RSS before any state, before the operation, and the peak during
    it (bytes). Large allocations are mapped and unmapped at once (glibc's
    ``MALLOC_MMAP_THRESHOLD_``), so RSS is the memory in use, not what the allocator kept."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    rows = {}
    for phase in ("save", "restore"):
        mp.spawn(_rank, args=(world, mode, state_mib, str(root), phase), nprocs=world)
        rows[phase] = [json.loads((root / f"{phase}-{r}.json").read_text()) for r in range(world)]
    return rows
