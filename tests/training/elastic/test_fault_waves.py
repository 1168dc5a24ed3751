"""Faults in waves, from the outside: real agents (``python -m training.agent`` with the PET_* env
the operator sets) on a real etcd, a second fault landing while the group re-forms.

Spot capacity is reclaimed from several VMs within seconds, and the survivor may be slow (here:
stopped) while it happens. The second fault is injected on an event, not after a fixed delay:
once the second victim has joined the round the first eviction opened, and while that round is
still open (the stopped survivor holds it), so every run exercises the same interleaving.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from bench.chaos.store_excuse import calls
from lab.local.etcd_server import EmbeddedEtcd
from lab.local.process_tree import freeze_tree, is_alive, kill_tree
from tests.support.elastic_cluster import TINY, Cluster, faulty_store
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.etcd_v3 import Etcd
from training.elastic.launch import RendezvousSettings
from training.elastic.membership import ROOT
from training.records import METRICS, RESUMED, STARTED

# A stopped survivor's key outlives its last heartbeat by 5 s, so the round the first eviction
# opens stays open (it expects the survivor) until the second fault has landed.
SLOW_SURVIVOR = RendezvousSettings(join_timeout_s=60, keep_alive_max_attempt=5)
MAX_STEPS = 60
STALL_TIMEOUT_S = 12
"""The slow commit's agents: wedged after 12 s without a beat, less than its commit takes."""


def _rendezvous(cluster: Cluster, client: Etcd) -> tuple[dict, dict[int, list[str]]]:
    """The run's state and, per round, the node ids that joined it."""
    root = f"{ROOT}/rendezvous/{cluster.policy.rdzv_id}"
    state: dict = {}
    joined: dict[int, list[str]] = {}
    for kv in client.range(f"{root}/")[0]:
        rel = kv.key[len(root) :].strip("/").split("/")
        if rel == ["state"]:
            state = json.loads(kv.value)
        elif len(rel) == 3 and rel[0] == "join":
            joined.setdefault(int(rel[1]), []).append(rel[2])
    return state, joined


def _node_of(cluster: Cluster, name: str) -> str:
    """The id fragment of a node's agent: its ids are ``<host>-<agent pid>-<random>``."""
    return f"-{cluster.nodes[name].pid}-"


@pytest.mark.parametrize("second", ["sigterm", "sigkill", "sigterm-slow-commit"])
def test_a_second_eviction_while_the_group_reforms_leaves_the_survivor_training(
    etcd_server: EmbeddedEtcd, tmp_path: Path, second: str
) -> None:
    # Before the fix the survivor completed the round with the departed node as a member
    # (its join key outlived it), waited 300 s for that member's MASTER_ADDR in
    # RendezvousStoreInfo.build, and exited 1 (LookupError): a permanent failure of the job.
    # With a slow commit, the evicted node stays registered for seconds after its SIGTERM (it
    # commits its node's save before it leaves: chaos seed 23); its join withdrawn, the open
    # round waits for it and never makes it a member. The commit outlasts the agents' stall
    # timeout: the going node must still count as alive until its stop deadline, or the
    # survivor goes on alone and restores an older state.
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    cluster = Cluster(
        tmp_path, etcd_server.client_port, data, min_nodes=1, rendezvous=SLOW_SURVIVOR
    )
    client = Etcd("127.0.0.1", etcd_server.client_port, timeout_s=5)
    args = [*TINY, "--max-steps", str(MAX_STEPS), "--log-every", "1"]
    args += ["--min-step-time-s", "0.05", "--checkpoint-every-steps", "0"]
    stores = {name: faulty_store(tmp_path, name) for name in "abc"}
    conf = cluster.policy.pet_env()["PET_RDZV_CONF"]
    if second == "sigterm-slow-commit":
        conf += f",stall_timeout={STALL_TIMEOUT_S}"
    try:
        for name in "abc":
            cluster.start(name, args, env={**stores[name][1], "PET_RDZV_CONF": conf})
        cluster.wait_until(lambda: _steps_at(cluster, 3) >= 3, 180, "training at world 3")
        trained = cluster.max_step()
        # The round that trains at world 3: the first, or a second one when the third node
        # registered after the first round's last call (a loaded machine).
        state = _rendezvous(cluster, client)[0]
        training = state["round"]
        # The next round keeps this order, and its first live node completes it: the survivor
        # first, so the second victim, going, is never the one that would complete it.
        order = [n for member in state["members"] for n in "abc" if _node_of(cluster, n) in member]
        survivor, first, then = order
        frozen = freeze_tree(cluster.nodes[survivor].pid)  # the slow survivor
        os.kill(cluster.nodes[first].pid, signal.SIGTERM)  # the kubelet signals the container
        # The second fault, once its victim joined the round the first one opened.
        victim = _node_of(cluster, then)
        cluster.wait_until(
            lambda: any(victim in n for n in _rendezvous(cluster, client)[1].get(training + 1, [])),
            60,
            f"{then} to join round {training + 1}",
        )
        state = _rendezvous(cluster, client)[0]
        assert (state["round"], state["members"]) == (training + 1, None), state  # forming
        signalled = time.time()
        if second == "sigterm-slow-commit":  # its every read 5 s late from now: 20 s to commit
            stores[then][0].open(1e9, delay_s=5.0, ops=["get", "list"])
        if second.startswith("sigterm"):
            os.kill(cluster.nodes[then].pid, signal.SIGTERM)
        else:
            kill_tree(cluster.nodes[then].pid)
        if second != "sigterm-slow-commit":  # else the survivor comes back while it commits
            cluster.wait_exit(then, 60)
        for pid in frozen:
            if is_alive(pid):
                os.kill(pid, signal.SIGCONT)
        cluster.wait_exit(then, 60)
        assert cluster.wait_exit(survivor, 180) == 0, cluster.tail(30)
        later = [e for e in cluster.events(STARTED) if e["ts"] > signalled]
        assert {e["world_size"] for e in later if e["node"] == survivor} == {1}, later
        alone = [r for r in cluster.records(survivor) if r.get("event") == RESUMED]
        assert alone[-1]["world_size"] == 1, alone
        assert alone[-1]["step"] >= trained, (alone[-1], trained)  # no completed step lost
        assert cluster.max_step() == MAX_STEPS
        if second == "sigterm-slow-commit":  # the survivor waited for all of the commit
            agent_calls = _agents_store_calls(tmp_path, then, cluster.nodes[then].pid)
            committed = max(c["ts"] + c["duration_s"] for c in agent_calls)
            assert committed - signalled > STALL_TIMEOUT_S, agent_calls  # it outlasted the timeout
            alone_from = min(e["ts"] for e in later if e["node"] == survivor)
            assert alone_from > committed, (alone_from, committed)
    finally:
        cluster.close()


def _agents_store_calls(root: Path, name: str, agent_pid: int) -> list[dict]:
    """The store calls node ``name``'s agent made itself (its commit of the node's save)."""
    path = root / "store-calls" / f"{name}.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [c for c in calls(entries) if c["pid"] == agent_pid]


def _steps_at(cluster: Cluster, world: int) -> int:
    return sum(1 for r in cluster.records() if r["kind"] == METRICS and r["world_size"] == world)
