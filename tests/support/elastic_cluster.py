"""Test support: real torchrun agents ("nodes") on a real etcd, as the PyTorchJob runs them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.chaos.faulty_store import faulty_env
from bench.chaos.runner import StoreControl
from lab.local.process_tree import kill_tree, terminate_tree, tree
from tests.support.waiting import wait_until
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.storage import FileStore
from training.elastic.launch import ElasticPolicy, RendezvousSettings, train_command, worker_env
from training.records import METRICS, events_named, read_log

REPO = Path(__file__).resolve().parents[2]
WHOLE_FIRST_ROUND = RendezvousSettings(join_timeout_s=60, last_call_timeout_s=60)
"""Rendezvous clocks for a test that starts every node at once and means them all to be in the
first round: it completes as soon as ``max_nodes`` joined, waiting up to 60 s for a cold start
on a loaded machine (the default last call, 1 s after ``min_nodes``, can leave a late node to
a second round, so a fault at step 5 may land before that node is in)."""
TINY = [
    "--model-width",
    "4",
    "--model-blocks",
    "1",
    "--global-batch-size",
    "24",
    "--micro-batch-size",
    "8",
]


class Cluster:
    """Nodes started with the same PET_* env and worker env as the PyTorchJob's pods."""

    def __init__(
        self,
        root: Path,
        rdzv_port: int,
        data_dir: Path,
        *,
        min_nodes: int = 1,
        max_nodes: int = 3,
        collective_timeout_s: int = 5,
        launcher: str = "warm",
        nproc_per_node: int = 1,
        max_restarts: int = 20,
        rendezvous: RendezvousSettings | None = None,
        checkpoint_uri: str | None = None,
        rdzv_host: str = "127.0.0.1",
        etcd_members: tuple[str, ...] = (),
        wrap: Callable[[str, list[str]], list[str]] | None = None,
    ) -> None:
        self.root = root
        self.wrap = wrap
        """How node ``name`` runs a command (in a network namespace: lab/local/netns.py)."""
        self.policy = ElasticPolicy(
            rdzv_host=rdzv_host,
            rdzv_port=rdzv_port,
            rdzv_id=f"test-{uuid.uuid4().hex[:8]}",
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            max_restarts=max_restarts,
            nproc_per_node=nproc_per_node,
            rendezvous=rendezvous or RendezvousSettings(join_timeout_s=60),
            etcd_members=etcd_members,
        )
        self.data_dir = data_dir
        self.checkpoints = root / "checkpoints"
        self.blob_uri = checkpoint_uri
        """A Blob URI (Azurite) for the durable store, instead of the directory."""
        self.collective_timeout_s = collective_timeout_s
        self.launcher = launcher
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, train_args: list[str], env: dict[str, str] | None = None) -> None:
        """Node ``name``, with ``env`` over the job's (a fault injected on this node only)."""
        extra = env or {}
        env = {
            **os.environ,
            **self.policy.pet_env(),
            "OMP_NUM_THREADS": "1",
            **worker_env(
                checkpoint_uri=self.blob_uri or str(self.checkpoints),
                local_dir=str(self.root / f"local-{name}"),
                collective_timeout_s=self.collective_timeout_s,
                launcher=self.launcher,
            ),
            **extra,
        }
        command = train_command(["--data-dir", str(self.data_dir), *train_args], sys.executable)
        if self.wrap is not None:
            command = self.wrap(name, command)
        with (
            open(self.root / f"{name}.out", "wb") as out,
            open(self.root / f"{name}.err", "wb") as err,
        ):
            self.nodes[name] = subprocess.Popen(
                command, env=env, cwd=REPO, stdout=out, stderr=err, start_new_session=True
            )

    def records(self, name: str | None = None) -> list[dict[str, Any]]:
        names = [name] if name else list(self.nodes)
        # A node may be writing its last line while it is read: the reader skips a torn one.
        found = [r for n in names for r in read_log(self.root / f"{n}.out", n)]
        return sorted(found, key=lambda r: r["ts"])

    def events(self, name: str) -> list[dict[str, Any]]:
        return events_named(self.records(), name)

    def steps_at(self, world: int) -> int:
        """Metrics lines logged at world size ``world``."""
        return sum(1 for r in self.records() if r["kind"] == METRICS and r["world_size"] == world)

    def max_step(self) -> int:
        return max((r["step"] for r in self.records() if r["kind"] == METRICS), default=0)

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        wait_until(
            condition, timeout_s, what, detail=lambda: f"logs in {self.root}:\n{self.tail()}"
        )

    def wait_exit(self, name: str, timeout_s: float) -> int:
        try:
            return self.nodes[name].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"node {name} still running after {timeout_s}s:\n{self.tail()}"
            ) from None

    def kill(self, name: str) -> None:
        kill_tree(self.nodes[name].pid)

    def evict(self, name: str, grace_s: float = 25.0) -> None:
        terminate_tree(self.nodes[name].pid, grace_s)

    def shut_down(self, name: str) -> list[int]:
        """SIGTERM every process of node ``name`` at once (agent, fork server, workers), as an
        OS shutdown delivers it; the pids signalled. The node's grace is its own to use."""
        pids = tree(self.nodes[name].pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return pids

    def tail(self, lines: int = 15) -> str:
        parts = []
        for n in self.nodes:
            err = (self.root / f"{n}.err").read_text().splitlines()[-lines:]
            parts.append(f"--- {n}.err\n" + "\n".join(err))
        return "\n".join(parts)

    def close(self) -> None:
        for process in self.nodes.values():
            if process.poll() is None:
                kill_tree(process.pid)
                process.wait(10)


def faulty_store(root: Path, name: str) -> tuple[StoreControl, dict[str, str]]:
    """Node ``name``'s durable store with trouble on demand (bench/chaos/faulty_store.py): the
    control a test opens windows on (``open``, from then on), and the env that gives it to the
    node, its calls logged in ``<root>/store-calls/<name>.jsonl``."""
    store = StoreControl(root / f"store-trouble-{name}.jsonl", root / "store-calls")
    log = store.logs / f"{name}.jsonl"
    return store, faulty_env(store.control, log)


PARAMETERS = ("model.model.", "trainer.extras.ema.")
"""The parameters in a checkpoint (DCP's flattened names), and a task's EMA when it keeps
one: compared as exactly as the parameters."""


def final_parameters(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    scratch = checkpoint_dir.parent / f".{checkpoint_dir.name}-read"
    read = ShardedCheckpoints(FileStore(checkpoint_dir), scratch).read_whole(PARAMETERS)
    assert read is not None, f"no checkpoint in {checkpoint_dir} verifies"
    return read[1]


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
