"""A partition, from the outside: three real agents (``python -m training.agent`` with the
operator's PET_* env), each in a network namespace of its own (lab/local/netns.py), one cut off
from the other two but not from etcd.

Before, the cut-off node's key stayed fresh, so every new round took it in, failed in the
workers' first collective, and spent a restart on every node until all exited 138. Now the
two that reach each other train on, the cut-off node is left out, and it rejoins once the
partition heals; the steps are counted from every node's log.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.local import netns
from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary
from lab.report.outcomes import groups_at_once
from tests.support.elastic_cluster import TINY, Cluster
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.etcd_v3 import Etcd
from training.elastic.launch import RendezvousSettings
from training.records import METRICS, STEP_COMPLETED

MAX_RESTARTS = 3
# torch's agent, spending one: "[default] Worker group FAILED. 2/3 attempts left; will restart
# worker group" (torch/distributed/elastic/agent/server/api.py, ``_invoke_run``).
_ATTEMPTS_LEFT = re.compile(r"Worker group \w+\. (\d+)/\d+ attempts left")


@pytest.fixture
def network() -> Iterator[netns.Network]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"a partition needs network namespaces: {reason}")
    with netns.Network(["a", "b", "c"]) as net:
        yield net


@pytest.fixture
def bridged_etcd(
    network: netns.Network, tmp_path: Path, etcd: None, torchrun: None
) -> Iterator[EmbeddedEtcd]:
    """etcd on the bridge's host address, where every namespace reaches it."""
    server = EmbeddedEtcd(
        find_etcd_binary(),
        tmp_path / "etcd-data",
        tmp_path / "etcd.log",
        host=network.host_addr,
    )
    with server:
        yield server


def _restarts_spent(cluster: Cluster, name: str) -> int:
    left = [int(m) for m in _ATTEMPTS_LEFT.findall((cluster.root / f"{name}.err").read_text())]
    return MAX_RESTARTS - min(left, default=MAX_RESTARTS)


def _steps(cluster: Cluster, name: str, world: int, after: float = 0.0) -> int:
    """Steps ``name`` completed at ``world`` since ``after``: rank 0 logs each as metrics,
    the other ranks as ``step_completed``."""
    return sum(
        1
        for r in cluster.records(name)
        if (r["kind"] == METRICS or r.get("event") == STEP_COMPLETED)
        and r["world_size"] == world
        and r["ts"] > after
    )


def _last_ts(cluster: Cluster) -> float:
    return max((r["ts"] for r in cluster.records()), default=0.0)


def test_a_node_cut_off_from_its_peers_is_left_out_and_rejoins_once_the_partition_heals(
    network: netns.Network, bridged_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    cluster = Cluster(
        tmp_path,
        bridged_etcd.client_port,
        data,
        min_nodes=1,
        max_restarts=MAX_RESTARTS,
        collective_timeout_s=30,  # the cluster's: a restart spent would be the workers' own
        rendezvous=RendezvousSettings(join_timeout_s=120),
        rdzv_host=network.host_addr,
        wrap=network.command,
    )
    args = [*TINY, "--max-steps", "100000", "--log-every", "1"]
    args += ["--min-step-time-s", "0.1", "--checkpoint-every-steps", "0"]
    try:
        for name in ("a", "b", "c"):
            cluster.start(name, args, env=network.env(name))
        cluster.wait_until(
            lambda: all(_steps(cluster, n, 3) >= 3 for n in "abc"), 240, "training at world 3"
        )
        network.cut("c")
        cut_at = _last_ts(cluster)
        # The two that reach each other train on without c, and c trains with nobody.
        cluster.wait_until(
            lambda: all(_steps(cluster, n, 2, cut_at) >= 20 for n in "ab"),
            180,
            "a and b training at world 2 while c is cut off",
        )
        assert _steps(cluster, "c", 3, cut_at) <= 1, "c trained on with peers it cannot reach"
        assert not any(_steps(cluster, "c", w, cut_at) for w in (1, 2)), "c formed a group"
        network.heal("c")
        healed_at = _last_ts(cluster)
        cluster.wait_until(
            lambda: all(_steps(cluster, n, 3, healed_at) >= 5 for n in "abc"),
            180,
            "c back in the group at world 3 after the partition healed",
        )
        for name in "abc":
            assert cluster.nodes[name].poll() is None, f"{name} exited:\n{cluster.tail(30)}"
        # Each member probes the next in the order: the group re-formed before the workers'
        # collective timed out, so the partition spent no restart of any node.
        spent = {n: _restarts_spent(cluster, n) for n in "abc"}
        assert spent == dict.fromkeys("abc", 0), (spent, cluster.tail(30))
    finally:
        cluster.close()


def _fenced(cluster: Cluster, name: str) -> bool:
    """``name``'s agent stopped its workers: its lease may have expired (permit.py)."""
    return "fenced" in (cluster.root / f"{name}.err").read_text()


def _registered(server: EmbeddedEtcd, cluster: Cluster) -> set[str]:
    root = f"/spot-lab/rendezvous/{cluster.policy.rdzv_id}/nodes/"
    kvs, _ = Etcd(server.host, server.client_port).range(root)
    return {kv.key for kv in kvs}


def test_two_nodes_cut_off_from_etcd_but_not_from_each_other_never_train_beside_a_third(
    network: netns.Network, bridged_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    """a and b lose etcd (a member cut off from the quorum, a subnet cut) but not each other;
    c arrives once their keys are gone. Before, nothing in a and b stopped, and c, reading no
    key of theirs, took them for dead unprobed and trained alone beside them. Now a and b stop
    once their lease may have expired (their permit's fence), c probes the round's members at
    the addresses the round published before it counts them gone, and once etcd answers again
    the three form one group."""
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    cluster = Cluster(
        tmp_path,
        bridged_etcd.client_port,
        data,
        min_nodes=1,
        rendezvous=RendezvousSettings(join_timeout_s=120),
        rdzv_host=network.host_addr,
        wrap=network.command,
    )
    args = [*TINY, "--max-steps", "100000", "--log-every", "1"]
    args += ["--min-step-time-s", "0.1", "--checkpoint-every-steps", "0"]
    try:
        for name in ("a", "b"):
            cluster.start(name, args, env=network.env(name))
        cluster.wait_until(
            lambda: all(_steps(cluster, n, 2) >= 3 for n in "ab"), 240, "a and b at world 2"
        )
        for name in ("a", "b"):
            network.cut_from_host(name)
        cluster.wait_until(
            lambda: not _registered(bridged_etcd, cluster), 60, "a's and b's keys expired"
        )
        cluster.start("c", args, env=network.env("c"))
        # The first of a and b past its fence stops its workers; the other's lose their peer.
        cluster.wait_until(
            lambda: _steps(cluster, "c", 1) >= 5 or any(_fenced(cluster, n) for n in "ab"),
            120,
            "c training alone, or a or b fenced",
        )
        for name in ("a", "b"):
            network.heal_host(name)
        healed_at = _last_ts(cluster)
        logged = {n: len((cluster.root / f"{n}.err").read_text()) for n in "ab"}
        cluster.wait_until(
            lambda: all(_steps(cluster, n, 3, healed_at) >= 5 for n in "abc"),
            180,
            "one group of three once etcd answers again",
        )
        assert groups_at_once(cluster.records()) == [], cluster.tail(30)
        # A round joined once etcd answers starts its workers on a renewed lease: before, the
        # fence stayed where the cut left it until the next heartbeat, and re-formed the
        # group again at once (three rounds in half a second).
        for name in ("a", "b"):
            later = (cluster.root / f"{name}.err").read_text()[logged[name] :]
            assert "fenced" not in later, cluster.tail(30)
    finally:
        cluster.close()
