"""How a node's agent ends: what it still does after its workers are gone.

Real agents (``python -m training.agent`` with the operator's PET_* env) on a real etcd. Each
test holds the agent in the state it is about (between rounds; in the exit barrier) by an
event, not a delay: etcd stopped, so no round can form; a peer's agent stopped with its key
kept alive, so it is never found dead.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import SignalException

from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary
from tests.support.elastic_cluster import TINY, Cluster
from tests.support.trainer_harness import durable_head, saved_checkpoint
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.launch import RendezvousSettings
from training.elastic.rendezvous import register
from training.launcher import STOP, run_agent, torchrun_config
from training.records import EMERGENCY_SAVE, FINISHED

pytestmark = pytest.mark.usefixtures("torchrun")

ENDLESS = [*TINY, "--max-steps", "100000", "--log-every", "1", "--min-step-time-s", "0.05"]


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """Its own etcd per test (not the module's, tests/training/conftest.py): a test stops it."""
    with EmbeddedEtcd(find_etcd_binary(), tmp_path / "etcd", tmp_path / "etcd.log") as server:
        yield server


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    write_synthetic_cifar10(root, train_records=240, test_records=24, seed=1)
    return root


def _log(cluster: Cluster, name: str) -> str:
    return (cluster.root / f"{name}.err").read_text()


@pytest.mark.timeout(300)
def test_a_sigterm_between_rounds_makes_the_nodes_save_durable(
    etcd_server: EmbeddedEtcd, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every node evicted at once, right after a peer's loss: each survivor's worker saved the
    # last completed step on its node and exited 75, and its agent waits for the next round.
    # No worker is left to commit that save durably; the pods' disks go with them.
    monkeypatch.setenv("LOGLEVEL", "INFO")  # torch's agent says when it restarts its workers
    cluster = Cluster(tmp_path, etcd_server.client_port, data, min_nodes=1)
    args = [*ENDLESS, "--checkpoint-every-steps", "0"]  # no periodic save: only this one
    try:
        for name in ("a", "b", "c"):
            cluster.start(name, args)
        cluster.wait_until(lambda: cluster.steps_at(3) >= 3, 180, "training at world 3")
        etcd_server.stop()  # the next round cannot form: the agents stay between rounds
        killed_ts = max(r["ts"] for r in cluster.records())  # a late c's join saved too
        cluster.kill("c")
        for name in ("a", "b"):
            # Both: the agent's line, and the worker's event, which reaches the node's log
            # through the agent's copy of the worker's output, possibly after that line.
            cluster.wait_until(
                lambda n=name: (
                    "will restart worker group" in _log(cluster, n)
                    and any(
                        e["node"] == n and e["ts"] > killed_ts
                        for e in cluster.events(EMERGENCY_SAVE)
                    )
                ),
                60,
                f"{name}'s worker to save and exit",
            )
        saves = [e for e in cluster.events(EMERGENCY_SAVE) if e["ts"] > killed_ts]
        saved = {e["node"]: e["step"] for e in saves}
        # c's death can end the guard's all-reduce on one survivor and not the other, so the
        # two may hold steps one apart (a CI run: a 35, b 36); the newer one must be kept.
        assert set(saved) == {"a", "b"} and max(saved.values()) - min(saved.values()) <= 1, saved
        newest = max(saved.values())
        # A late c's join re-forms the first round, and that restart's save may be durable:
        # what matters is that no durable copy of the steps saved after the kill exists yet.
        before = durable_head(cluster.checkpoints)
        assert before is None or before.step < min(saved.values()), (before, saved)
        for name in ("a", "b"):
            os.kill(cluster.nodes[name].pid, signal.SIGTERM)
        for name in ("a", "b"):
            assert cluster.wait_exit(name, 60) == 143, cluster.tail()
        assert saved_checkpoint(cluster.checkpoints)["step"] == newest, cluster.tail()
        by_agent = {e["step"] for e in cluster.events(EMERGENCY_SAVE) if e["reason"] == "agent"}
        # Each agent commits its node's save only if it is newer than the durable head then.
        assert newest in by_agent and by_agent <= set(saved.values()), (by_agent, saved)
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_an_agent_whose_sigterm_exception_was_lost_forms_no_new_group(
    etcd_server: EmbeddedEtcd, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chaos seed 147: the SIGTERM's exception was raised inside a finalizer as torch started a
    # group, and Python drops those (test_launcher.py shows it). The agent re-formed as world 1
    # and trained on until the kubelet's SIGKILL: its steps past the last save were lost, and
    # no commit of its node's save ran. Here the handler has run and its exception is gone.
    monkeypatch.setattr(STOP, "at", time.monotonic())
    monkeypatch.setattr(STOP, "signum", signal.SIGTERM)
    monkeypatch.setenv("TRAIN_CHECKPOINT_URI", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("TRAIN_LOCAL_DIR", str(tmp_path / "local"))
    # run_agent sets it for torch's agent, in this process: restored for the other tests.
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    args = [
        "--nnodes=1",
        "--nproc-per-node=1",
        "--max-restarts=0",
        "--rdzv-backend=etcd",
        f"--rdzv-endpoint=127.0.0.1:{etcd_server.client_port}",
        f"--rdzv-id=lost-stop-{uuid.uuid4().hex[:8]}",
        "--module",
        "training.train",
        "--data-dir",
        str(data),
        *TINY,
        "--max-steps",
        "2",
    ]
    parsed, config = torchrun_config(args)
    config.rdzv_backend = register()
    handlers: list = []
    try:
        with pytest.raises(SignalException):
            run_agent(config, parsed.training_script_args, handlers)
        assert handlers[-1].round == 0  # it never joined a round: no worker started
    finally:
        handlers[-1].leave()


@pytest.mark.timeout(300)
def test_a_finished_node_does_not_wait_for_a_peer_that_died_after_finishing(
    etcd_server: EmbeddedEtcd, data: Path, tmp_path: Path
) -> None:
    # b's agent stops (its workers train on) and never reaches the exit barrier; its key's
    # TTL outlives the test, so a never finds it dead. torch's barrier waited 300 s for it.
    never_expires = RendezvousSettings(join_timeout_s=60, keep_alive_max_attempt=900)
    cluster = Cluster(
        tmp_path, etcd_server.client_port, data, min_nodes=2, max_nodes=2, rendezvous=never_expires
    )
    args = [*TINY, "--max-steps", "40", "--log-every", "1", "--min-step-time-s", "0.05"]
    try:
        for name in ("a", "b"):
            cluster.start(name, args)
        cluster.wait_until(lambda: cluster.steps_at(2) >= 3, 180, "training at world 2")
        os.kill(cluster.nodes["b"].pid, signal.SIGSTOP)  # the agent only
        cluster.wait_until(lambda: bool(cluster.events(FINISHED)), 180, "the end of training")
        # Far below torch's 300 s, far above the bound (EXIT_BARRIER_TIMEOUT_S).
        assert cluster.wait_exit("a", 150) == 0, cluster.tail()
        assert "Error waiting on exit barrier" in _log(cluster, "a")  # b never came
    finally:
        cluster.close()
