"""Elastic state: what a worker keeps on its node, and how the ranks agree where to resume.

On every (re)start each rank reports the newest state it can reach: its node's emergency save
(node-local disk, already verified) and the durable checkpoint the manifest names. The ranks
all-gather those claims, the holder of the newest one loads and verifies it, and broadcasts the
bytes. Every rank thus restores the same state, even if one node read a stale cached manifest.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.checkpoint import CheckpointRepository, Loaded, deserialize
from training.storage import FileStore

logger = logging.getLogger(__name__)

NONE = -1


class NodeLocalState:
    """Emergency saves and a progress marker on node-local disk (one writer: local rank 0)."""

    def __init__(self, root: str | Path, run_id: str) -> None:
        self.root = Path(root) / run_id
        self.repository = CheckpointRepository(FileStore(self.root), keep=1, prefix="emergency")
        self._progress_path = self.root / "progress"
        self._progress_fd: int | None = None

    def mark_progress(self, step: int) -> None:
        """Record the last completed step: one small pwrite, cheap enough for every step."""
        if self._progress_fd is None:
            self._progress_fd = os.open(self._progress_path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._progress_fd, f"{step:020d}".encode(), 0)

    def progress(self) -> int:
        try:
            return int(self._progress_path.read_text().strip() or NONE)
        except (FileNotFoundError, ValueError):
            return NONE

    def save(self, step: int, data: bytes) -> None:
        self.repository.commit(step, data)

    def load(self) -> Loaded | None:
        return self.repository.load_latest()


@dataclass(frozen=True)
class Resume:
    """Where this round starts."""

    state: dict[str, Any] | None
    step: int
    source: str
    """"fresh", "local" (a node's emergency save) or "durable"."""
    from_rank: int
    lost_steps: int | None
    """Progress any rank had recorded minus the resumed step; None when nothing was recorded."""
    seconds: float


class _Claims:
    """This rank's candidates: a verified local save and the durable head (claimed, then loaded)."""

    def __init__(self, local: NodeLocalState | None, durable: CheckpointRepository | None) -> None:
        self.local = local.load() if local else None
        self.durable = durable
        head = durable.head() if durable else None
        self.durable_step = head.step if head else NONE
        self.durable_loaded: Loaded | None = None

    def row(self, progress: int) -> list[int]:
        local_step = self.local.entry.step if self.local else NONE
        return [local_step, self.durable_step, progress]

    def materialize(self, source: str, step: int) -> Loaded | None:
        """The bytes for the claim, or None after lowering the durable claim to what verifies."""
        if source == "local":
            return self.local
        if self.durable_loaded is None or self.durable_loaded.entry.step != step:
            self.durable_loaded = self.durable.load_latest() if self.durable else None
        loaded = self.durable_loaded
        if loaded is not None and loaded.entry.step == step:
            return loaded
        self.durable_step = loaded.entry.step if loaded else NONE
        return None


def _pick(rows: torch.Tensor) -> tuple[int, str, int]:
    """(step, source, rank) of the newest claim; local beats durable (no storage read)."""
    best = int(rows[:, :2].max())
    for column, source in ((0, "local"), (1, "durable")):
        holders = (rows[:, column] == best).nonzero()
        if len(holders):
            return best, source, int(holders[0])
    raise AssertionError("unreachable")


def _broadcast_bytes(data: bytes | None, size: int, src: int, device: torch.device) -> bytes:
    if data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    return buffer.cpu().numpy().tobytes()


def agree_on_resume(
    rank: int,
    device: torch.device,
    local: NodeLocalState | None,
    durable: CheckpointRepository | None,
) -> Resume:
    """All ranks call this together; they return the same state."""
    started = time.monotonic()
    claims = _Claims(local, durable)
    progress = local.progress() if local else NONE
    while True:
        mine = torch.tensor(claims.row(progress), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        rows = torch.stack(gathered).cpu()
        known = int(rows[:, 2].max())
        if int(rows[:, :2].max()) == NONE:
            lost = known if known != NONE else None
            return Resume(None, 0, "fresh", NONE, lost, time.monotonic() - started)
        step, source, holder = _pick(rows)
        loaded = claims.materialize(source, step) if rank == holder else None
        header = torch.tensor(
            [int(loaded is not None), len(loaded.data) if loaded else 0], device=device
        )
        dist.broadcast(header, src=holder)
        if not int(header[0]):
            continue  # the holder lowered its claim to what verifies; agree again
        data = _broadcast_bytes(loaded.data if loaded else None, int(header[1]), holder, device)
        lost = max(known - step, 0) if known != NONE else None
        return Resume(deserialize(data), step, source, holder, lost, time.monotonic() - started)
