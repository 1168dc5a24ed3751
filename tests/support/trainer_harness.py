"""A real Trainer on a real gloo group of one (or a spawned rank), its stores and its events:
what the trainer's tests drive. A peer's loss is the exception gloo raises for it."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from training.api import TrainSpec
from training.checkpoints.checkpoint import CheckpointRepository, Entry
from training.checkpoints.lineage import store_lineage
from training.checkpoints.node_local import NodeLocalState
from training.checkpoints.sharded.repository import PREFIX, ShardedCheckpoints
from training.checkpoints.storage import FileStore, ObjectStore
from training.data.cifar10 import write_synthetic_cifar10
from training.loop.config import parse_config
from training.loop.dist import DistEnv, destroy_process_group, init_process_group
from training.loop.inputs import load_data, open_node_local
from training.loop.metrics import EventLog
from training.loop.trainer import Trainer
from training.records import events_named, read_lines

TINY = ["--model-width", "4", "--model-blocks", "1", "--global-batch-size", "8"]
TRAIN_RECORDS = 48


def make_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic dataset (for a module-scoped ``data_dir`` fixture)."""
    root = tmp_path_factory.mktemp("data")
    write_synthetic_cifar10(root, train_records=TRAIN_RECORDS, test_records=8, train_files=1)
    return root


@contextmanager
def one_process_world() -> Iterator[None]:
    """A gloo default group of one, for as long as the block runs."""
    init_process_group(DistEnv(), torch.device("cpu"), timeout_s=30)
    try:
        yield
    finally:
        destroy_process_group()


@dataclass
class Harness:
    trainer: Trainer
    durable: ShardedCheckpoints
    """The run's checkpoints (``torch.distributed.checkpoint``, in the durable store)."""
    local: NodeLocalState
    stream: io.StringIO

    def events(self, name: str) -> list[dict[str, Any]]:
        return events_named(read_lines(self.stream.getvalue()), name)


def harness(
    root: Path,
    data_dir: Path,
    *flags: str,
    store: ObjectStore | None = None,
    env: DistEnv | None = None,
    group: dist.ProcessGroup | None = None,
    tiny: Sequence[str] = TINY,
    spec: TrainSpec | None = None,
) -> Harness:
    """A Trainer of the task the flags name (cifar by default), or of ``spec`` in its place."""
    cfg = parse_config(
        [
            f"--data-dir={data_dir}",
            f"--checkpoint-uri={root / 'durable'}",
            f"--local-dir={root / 'local'}",
            *tiny,
            *flags,
        ],
        env={},
    )
    env = env or DistEnv()
    data = load_data(cfg)
    store = store or FileStore(root / "durable")
    local = open_node_local(cfg, env, data.train, store_lineage(store))
    stream = io.StringIO()
    events = EventLog(env, stream)
    device = torch.device("cpu")
    trainer = Trainer(cfg, env, device, data, store, local, events, group, spec=spec)
    return Harness(trainer, trainer.dcp.checkpoints, local, stream)


def sigterm_during(h: Harness, step: int, stop: SimpleNamespace) -> None:
    """SIGTERM arrives while step ``step`` (1-based) is in flight; the loop finishes it."""
    real_step = h.trainer.train_step

    def train_step() -> tuple[float, int]:
        if h.trainer.state.step == step - 1:
            stop.requested = True
        return real_step()

    h.trainer.train_step = train_step  # type: ignore[method-assign]


def saved_checkpoint(durable_dir: Path) -> dict[str, Any]:
    """The newest durable checkpoint in ``durable_dir`` whose files all verify: every value by
    DCP's flattened name (``model.model.<parameter>``, ``trainer.step``, ``run``: packed),
    and ``step``, the manifest's."""
    scratch = durable_dir.parent / f".{durable_dir.name}-read"
    read = ShardedCheckpoints(FileStore(durable_dir), scratch).read_whole("", values=True)
    assert read is not None, f"no checkpoint in {durable_dir} verifies"
    entry, values = read
    return {**values, "step": entry.step}


def under(saved: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The values of ``saved`` whose names start with ``prefix``, by the rest of the name."""
    return {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}


def durable_head(durable_dir: Path) -> Entry | None:
    """The newest checkpoint the manifests in ``durable_dir`` name (reads nothing else)."""
    return CheckpointRepository(FileStore(durable_dir), prefix=PREFIX).head()
