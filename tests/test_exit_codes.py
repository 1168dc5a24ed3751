"""How a node ends, as the code the training operator's ExitCode policy acts on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.etcd_server import EmbeddedEtcd, find_etcd_binary
from tests.elastic_cluster import TINY, Cluster
from training.data import write_synthetic_cifar10
from training.exit_codes import BAD_INPUT, ENDINGS, PERMANENT, RETRY_ME, RETRYABLE, signal_exit

REPO = Path(__file__).resolve().parents[1]

# training-operator v1, pkg/util/train/train_util.go, IsRetryableExitCode (release-1.9).
OPERATOR_RETRIES = {130, 137, 138, 143}


def test_the_table_agrees_with_the_operator() -> None:
    assert RETRYABLE == OPERATOR_RETRIES
    by_how = {e.how.split(" (")[0].split(",")[0]: e for e in ENDINGS}
    assert by_how["eviction or pod deletion"].code == 143
    assert by_how["eviction or pod deletion"].retried
    assert not by_how["training finished"].retried
    for ending in ENDINGS:
        if ending.code in (BAD_INPUT, PERMANENT):
            assert not ending.retried, ending  # fails the job and frees its GPU nodes
    assert signal_exit(signal.SIGTERM) == 143 and signal_exit(signal.SIGINT) == 130
    assert RETRY_ME in OPERATOR_RETRIES


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    root = tmp_path_factory.mktemp("etcd")
    with EmbeddedEtcd(find_etcd_binary(), root / "data", root / "etcd.log") as server:
        yield server


def test_missing_data_stops_the_node_before_it_joins(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    # Every worker would fail the same way on every restart, spending the whole budget on
    # billed GPU nodes; the agent checks the data first and exits 2, which fails the job.
    env = {
        "PATH": "/usr/bin:/bin",
        "TRAIN_RDZV_WAIT_S": "0",
        "TRAIN_LAUNCHER": "warm",
        "PET_RDZV_BACKEND": "etcd-v2",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{etcd.client_port}",
    }
    args = ["--nnodes=1", "--rdzv-id=missing-data", "--module", "training.train"]
    args += ["--data-dir", str(tmp_path / "nothing"), "--checkpoint-uri", str(tmp_path / "c")]
    result = subprocess.run(
        [sys.executable, "-m", "training.agent", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == BAD_INPUT, result.stderr[-2000:]
    assert f"CIFAR-10 data directory {tmp_path / 'nothing'} does not exist" in result.stderr
    assert "Starting elastic_operator" not in result.stderr  # it never joined a rendezvous


@pytest.mark.slow
def test_an_eviction_ends_the_node_with_143(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    # Uncaught, torch's SignalException made the agent exit 1: under ExitCode the first
    # eviction would have failed the whole job for good. This also fails if a torch upgrade
    # stops raising SignalException (with its sigval) out of the elastic agent on SIGTERM.
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    cluster = Cluster(tmp_path, etcd.client_port, data, min_nodes=1, max_nodes=1)
    try:
        cluster.start("a", [*TINY, "--max-steps", "100000", "--log-every", "1"])
        cluster.wait_until(lambda: cluster.max_step() >= 2, 120, "training to run")
        os.kill(cluster.nodes["a"].pid, signal.SIGTERM)  # the kubelet signals the container
        assert cluster.wait_exit("a", 60) == 143, cluster.tail()
    finally:
        cluster.close()


@pytest.mark.slow
def test_an_etcd_outage_asks_for_a_new_pod(tmp_path: Path) -> None:
    # torch's agent raises a RendezvousConnectionError when etcd stops answering. Uncaught it
    # exited 1, which fails the whole job under ExitCode; 138 is retried by the operator.
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    root = tmp_path / "etcd"
    with EmbeddedEtcd(find_etcd_binary(), root / "data", root / "etcd.log") as server:
        cluster = Cluster(tmp_path, server.client_port, data, min_nodes=1, max_nodes=1)
        try:
            cluster.start("a", [*TINY, "--max-steps", "100000", "--log-every", "1"])
            cluster.wait_until(lambda: cluster.max_step() >= 2, 120, "training to run")
            server.stop()
            assert cluster.wait_exit("a", 90) == RETRY_ME, cluster.tail()
            assert "rendezvous failed" in (tmp_path / "a.err").read_text()
        finally:
            cluster.close()
