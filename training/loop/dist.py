"""The distributed environment, parsed once from what torchrun exports."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from training.elastic.launch import ROUND_FILE_ENV


@dataclass(frozen=True)
class DistEnv:
    """Who this worker is in the current rendezvous round."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "standalone"
    rdzv_round: int = 0
    """The rendezvous round this worker's group formed in (0: not known), from the file the
    agent writes (training/elastic/rendezvous.py)."""

    @property
    def last_round(self) -> bool:
        """This node's agent will not restart these workers again: its budget is spent."""
        return self.launched and self.restart_count >= self.max_restarts

    @property
    def launched(self) -> bool:
        """True under torchrun (MASTER_ADDR/PORT exported), False for a plain ``python`` run."""
        return self.run_id != "standalone"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if env is None else env
        if "RANK" not in env:
            return cls()
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            group_rank=int(env.get("GROUP_RANK", "0")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
            run_id=env.get("TORCHELASTIC_RUN_ID", "torchrun"),
            rdzv_round=_round(env.get(ROUND_FILE_ENV, "")),
        )


def _round(path: str) -> int:
    try:
        return int(json.loads(Path(path).read_text())["round"]) if path else 0
    except (OSError, ValueError, KeyError):
        return 0


def device_for(env: DistEnv) -> torch.device:
    """One GPU per local rank when there are GPUs; the CPU otherwise."""
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(env: DistEnv, device: torch.device, timeout_s: int) -> None:
    """NCCL on GPUs, gloo on CPUs; the timeout bounds every collective (a frozen peer)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if env.launched:
        dist.init_process_group(
            backend, timeout=timeout, device_id=device if backend == "nccl" else None
        )
    else:
        # A single process without torchrun: an in-memory store, world size 1.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )


def new_checkpoint_group(timeout_s: int) -> dist.ProcessGroup:
    """A gloo group over all ranks for collectives that wait on storage (restore, final save).

    Its long timeout lets one rank read or write a slow store while the others wait; the
    default group keeps the short timeout that detects a frozen peer. Gloo carries CPU tensors
    even when the default group is NCCL, so checkpoint bytes never go through the GPU.
    Every rank must call this, in the same order relative to other group creations.
    """
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
