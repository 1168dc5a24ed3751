"""On a node with several processes, torch closing the node's workers is not an eviction: the
save stays on the node, and only a SIGTERM that reached the agent asks for a durable commit.
Real agents on a real etcd, two processes each, Azurite as the durable store."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.local.etcd_server import EmbeddedEtcd
from tests.support.elastic_cluster import TINY, Cluster
from training.data.cifar10 import write_synthetic_cifar10
from training.records import EMERGENCY_SAVE, RESUMED

pytestmark = [pytest.mark.slow]

# No periodic save: a durable checkpoint can only be an emergency save's.
ARGS = [
    *TINY,
    "--max-steps=100000",
    "--log-every=1",
    "--min-step-time-s=0.05",
    "--checkpoint-every-steps=0",
]


def _saves_after(cluster: Cluster, node: str, ts: float) -> list[dict]:
    return [e for e in cluster.events(EMERGENCY_SAVE) if e["node"] == node and e["ts"] > ts]


@pytest.mark.timeout(300)
def test_torch_closing_the_workers_keeps_the_save_on_the_node_an_eviction_does_not(
    tmp_path: Path, etcd_server: EmbeddedEtcd, azurite: str, blob_container_uri: str
) -> None:
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    cluster = Cluster(
        tmp_path / "run",
        etcd_server.client_port,
        data,
        min_nodes=1,
        max_nodes=2,
        nproc_per_node=2,
        checkpoint_uri=f"{blob_container_uri}/ckpt",
    )
    cluster.root.mkdir()
    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite}
    try:
        cluster.start("a", ARGS, env=env)
        cluster.wait_until(lambda: cluster.steps_at(2) >= 3, 180, "a training alone")
        joined_ts = max(r["ts"] for r in cluster.records())
        # b joins: a's agent re-forms the group, closing a's two workers with torch's SIGTERM.
        cluster.start("b", ARGS, env=env)
        cluster.wait_until(lambda: cluster.steps_at(4) >= 2, 180, "a and b training together")
        closed = _saves_after(cluster, "a", joined_ts)
        # The rank torch stopped saves for its SIGTERM; its sibling, whose step's vote that stop
        # turned to no, saves the same step as a lost peer's. Both stay on the node.
        assert any(e["reason"] == "sigterm" for e in closed), closed
        assert all(e["local"] and not e["durable"] for e in closed), closed
        resumed = [e for e in cluster.events(RESUMED) if e["ts"] > joined_ts]
        assert resumed[0]["world_size"] == 4 and resumed[0]["source"] == "local", resumed
        assert resumed[0]["lost_steps"] == 0
        # a is evicted: its agent's SIGTERM, then the workers' (torch's): now it is durable.
        evicted_ts = max(r["ts"] for r in cluster.records())
        cluster.evict("a")
        cluster.wait_until(
            lambda: any(e["durable"] for e in _saves_after(cluster, "a", evicted_ts)),
            120,
            "a's eviction save made durable",
        )
    finally:
        cluster.close()
