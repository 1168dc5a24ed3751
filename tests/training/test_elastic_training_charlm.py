"""The character LM on real torchrun agents and a real etcd: a node killed hard, a node frozen
(no FIN, no RST), a new node joining and then a node evicted (SIGTERM, then gone). In float64
each run ends where an uninterrupted one ends, with no completed step lost, as the CIFAR task
does (tests/training/test_elastic_training.py): the guarantees belong to the API, not to a task.
Dropout is on and the scheduler is still warming up when the faults land.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lab.local.etcd_server import EmbeddedEtcd
from lab.local.process_tree import freeze_tree
from tests.support.elastic_cluster import (
    WHOLE_FIRST_ROUND,
    Cluster,
    final_parameters,
    max_abs_difference,
)
from tests.support.exactness import TOLERANCE, make_data
from training.records import EMERGENCY_SAVE, EVALUATED, RESUMED

pytestmark = pytest.mark.usefixtures("torchrun")

MAX_STEPS = 40
ARGS = [
    "--task=charlm",
    "--block-size=16",
    "--n-layer=1",
    "--n-head=2",
    "--n-embd=16",
    "--dropout=0.2",
    "--ema-decay=0.9",  # an extra's state: saved, restored and compared like the parameters
    "--warmup-steps=16",
    "--decay-steps=40",
    "--eval-every=8",
    "--global-batch-size=12",
    "--micro-batch-size=4",
    "--dtype=float64",
    f"--max-steps={MAX_STEPS}",
    "--log-every=1",
    "--checkpoint-every-steps=4",
    # Pacing (it changes no number): the 16 warmup steps last 2.4 s, so a fault at step 5 lands
    # in them. The join test paces slower: a new node boots while the others still train.
    "--min-step-time-s=0.15",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data("charlm", tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, etcd_server: EmbeddedEtcd, corpus: Path
) -> dict[str, torch.Tensor]:
    """An uninterrupted run at world size 2, unpaced: pacing changes no number, and both nodes
    are in the first round (min_nodes=2), so there is nothing to wait for."""
    root = tmp_path_factory.mktemp("reference")
    cluster = Cluster(root, etcd_server.client_port, corpus, min_nodes=2, max_nodes=2)
    try:
        for node in ("r0", "r1"):
            cluster.start(node, [*ARGS, "--min-step-time-s=0"])
        assert cluster.wait_exit("r0", 180) == 0 and cluster.wait_exit("r1", 60) == 0, (
            cluster.tail()
        )
    finally:
        cluster.close()
    return final_parameters(cluster.checkpoints)


@pytest.fixture
def clusters(
    tmp_path: Path, etcd_server: EmbeddedEtcd, corpus: Path
) -> Iterator[Callable[..., Cluster]]:
    """A cluster with the test's own elastic settings (``Cluster``'s keywords)."""
    made: list[Cluster] = []

    def make(**settings: Any) -> Cluster:
        made.append(Cluster(tmp_path, etcd_server.client_port, corpus, **settings))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def _after(cluster: Cluster, kind: str, ts: float) -> list[dict]:
    return [e for e in cluster.events(kind) if e["ts"] > ts]


@pytest.mark.timeout(300)
def test_a_node_killed_mid_warmup_loses_no_step_and_keeps_the_trajectory(
    clusters: Callable[..., Cluster], reference: dict[str, torch.Tensor]
) -> None:
    cluster = clusters(rendezvous=WHOLE_FIRST_ROUND)
    for node in ("a", "b", "c"):
        cluster.start(node, ARGS)
    cluster.wait_until(lambda: cluster.steps_at(3) >= 5, 180, "step 5 at world size 3")
    fault_ts = max(r["ts"] for r in cluster.records())
    cluster.kill("c")
    for node in ("a", "b"):
        assert cluster.wait_exit(node, 180) == 0, cluster.tail()
    resumed = _after(cluster, RESUMED, fault_ts)[0]
    assert (resumed["world_size"], resumed["source"], resumed["lost_steps"]) == (2, "local", 0)
    assert max_abs_difference(final_parameters(cluster.checkpoints), reference) < TOLERANCE
    assert {e["step"] for e in cluster.events(EVALUATED)} == {8, 16, 24, 32, 40}


@pytest.mark.timeout(300)
def test_a_new_node_joining_then_an_eviction_keep_the_trajectory(
    clusters: Callable[..., Cluster], reference: dict[str, torch.Tensor]
) -> None:
    cluster = clusters(min_nodes=2)  # a and b both in the first round, however late one starts
    # Slower pacing (it changes no number): the 37 steps left must outlast a new node's cold
    # start, which took 14 s on a machine loaded to 10 (the run had ended by then at 0.25 s).
    paced = [*ARGS, "--min-step-time-s=0.75"]
    for node in ("a", "b"):
        cluster.start(node, paced)
    cluster.wait_until(lambda: cluster.steps_at(2) >= 3, 180, "3 steps at world size 2")
    cluster.start("d", paced)  # a node id that never took part: the scale-up path
    cluster.wait_until(lambda: cluster.steps_at(3) >= 2, 120, "2 steps at world size 3")
    evicted_ts = max(r["ts"] for r in cluster.records())
    cluster.evict("b")  # the Spot notice: SIGTERM, the grace, then SIGKILL
    for node in ("a", "d"):
        assert cluster.wait_exit(node, 180) == 0, cluster.tail()
    # The evicted worker saves on its SIGTERM (its agent may commit that save: "agent"); the
    # survivors see the peer go, or are stopped by their agents for the next round.
    reasons = {e["reason"] for e in _after(cluster, EMERGENCY_SAVE, evicted_ts)}
    assert "sigterm" in reasons and reasons <= {"sigterm", "peer_failure", "agent"}
    rounds = cluster.events(RESUMED)[1:]  # after the first: the join's, then the eviction's
    assert [r["world_size"] for r in rounds][:1] == [3] and rounds[-1]["world_size"] == 2
    assert all(r["lost_steps"] == 0 for r in rounds if r["source"] == "local")
    assert max_abs_difference(final_parameters(cluster.checkpoints), reference) < TOLERANCE


@pytest.mark.timeout(300)
def test_a_frozen_node_is_left_behind_with_no_step_lost(
    clusters: Callable[..., Cluster], reference: dict[str, torch.Tensor]
) -> None:
    cluster = clusters(rendezvous=WHOLE_FIRST_ROUND)
    for node in ("a", "b", "c"):
        cluster.start(node, ARGS)
    cluster.wait_until(lambda: cluster.steps_at(3) >= 4, 180, "4 steps at world size 3")
    freeze_tree(cluster.nodes["c"].pid)  # a VM that vanished: its key expires, no probe answer
    fault_ts = max(r["ts"] for r in cluster.records())
    try:
        cluster.wait_until(lambda: bool(_after(cluster, RESUMED, fault_ts)), 60, "a resume")
    finally:
        cluster.kill("c")
    resumed = _after(cluster, RESUMED, fault_ts)[0]
    assert (resumed["world_size"], resumed["lost_steps"]) == (2, 0)
    for node in ("a", "b"):
        assert cluster.wait_exit(node, 180) == 0, cluster.tail()
    assert max_abs_difference(final_parameters(cluster.checkpoints), reference) < TOLERANCE
