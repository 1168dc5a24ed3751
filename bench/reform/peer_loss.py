"""One peer loss on two nodes of two processes each, their durable store on Azurite.

Real agents (``python -m training.agent``, the PyTorchJob's PET_* env) on an embedded etcd, as
the tests' cluster starts them. Both nodes train at world size 4; the node without global rank
0 is killed (SIGKILL, its whole tree); the measure is from the kill to the survivor's first
step at world size 2, and whether the survivor's saves in between went to Azurite. When one
of the survivor's workers exits after the loss, torch closes the other with SIGTERM: before
issue 36 that made rank 0 commit its save durably before the group could re-form.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.commit_deadline import AZURITE_ACCOUNT, AZURITE_KEY, azurite
from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary
from lab.local.process_tree import kill_tree
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.launch import ElasticPolicy, RendezvousSettings, train_command, worker_env
from training.records import EMERGENCY_SAVE, METRICS, Record, read_log

REPO = Path(__file__).resolve().parents[2]
STEPS_BEFORE_LOSS = 5
"""Steps at world size 4 before the kill: both nodes warm."""


def _records(out: Path) -> list[Record]:
    return read_log(out)


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _start(name: str, root: Path, policy: ElasticPolicy, uri: str, conn: str, args: list[str]):
    env = {
        **os.environ,
        **policy.pet_env(),
        "OMP_NUM_THREADS": "1",
        **worker_env(
            checkpoint_uri=uri, local_dir=str(root / f"local-{name}"), collective_timeout_s=5
        ),
        "AZURE_STORAGE_CONNECTION_STRING": conn,
    }
    with open(root / f"{name}.out", "wb") as out, open(root / f"{name}.err", "wb") as err:
        return subprocess.Popen(
            train_command(args, sys.executable),
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def one_loss(model_width: int) -> dict[str, Any]:
    """Train a and b, kill b; the seconds to a's first step at world 2, and a's saves."""
    with tempfile.TemporaryDirectory(prefix="bench-reform-") as tmp:
        root = Path(tmp)
        data = root / "data"
        write_synthetic_cifar10(data, train_records=480, test_records=24, seed=1)
        args = ["--data-dir", str(data), "--model-width", str(model_width)]
        args += ["--model-blocks", "1", "--global-batch-size", "24", "--micro-batch-size", "8"]
        args += ["--max-steps", "100000", "--log-every", "1", "--checkpoint-every-steps", "0"]
        with (
            azurite(root / "azurite") as account_url,
            EmbeddedEtcd(find_etcd_binary(), root / "etcd", root / "etcd.log") as etcd,
        ):
            conn = (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};BlobEndpoint={account_url};"
            )
            policy = ElasticPolicy(
                rdzv_host="127.0.0.1",
                rdzv_port=etcd.client_port,
                rdzv_id=f"bench-{uuid.uuid4().hex[:8]}",
                min_nodes=1,
                max_nodes=2,
                max_restarts=20,
                nproc_per_node=2,
                rendezvous=RendezvousSettings(join_timeout_s=60),
            )
            uri = f"{account_url}/bench{uuid.uuid4().hex[:8]}/ckpt"
            nodes = {n: _start(n, root, policy, uri, conn, args) for n in ("a", "b")}
            try:
                return _measure(root, nodes)
            finally:
                for process in nodes.values():
                    if process.poll() is None:
                        kill_tree(process.pid)
                        process.wait(10)


def _metrics(root: Path, node: str, world: int, after: float = 0.0) -> list[dict[str, Any]]:
    """The metrics lines (rank 0's) ``node`` logged at ``world`` after ``after``."""
    return [
        r
        for r in _records(root / f"{node}.out")
        if r["kind"] == METRICS and r["world_size"] == world and r["ts"] > after
    ]


def _measure(root: Path, nodes: dict[str, subprocess.Popen[bytes]]) -> dict[str, Any]:
    """Kill the node without rank 0: rank 0's node survives, as in the issue's sequence."""

    def leader() -> str | None:
        return next((n for n in nodes if len(_metrics(root, n, 4)) >= STEPS_BEFORE_LOSS), None)

    _wait(lambda: leader() is not None, 240, "both nodes at world size 4")
    survivor = leader()
    assert survivor is not None
    lost = next(n for n in nodes if n != survivor)
    killed = time.time()
    kill_tree(nodes[lost].pid)
    _wait(lambda: bool(_metrics(root, survivor, 2, killed)), 120, "the first step at world 2")
    first = _metrics(root, survivor, 2, killed)[0]
    saves = [
        r
        for r in _records(root / f"{survivor}.out")
        if r.get("event") == EMERGENCY_SAVE and killed < r["ts"] <= first["ts"]
    ]
    return {
        "reform_s": round(first["ts"] - killed, 3),
        "durable_saves": sum(1 for s in saves if s["durable"]),
        "save_s": max((s["seconds"] for s in saves if "seconds" in s), default=None),
    }
