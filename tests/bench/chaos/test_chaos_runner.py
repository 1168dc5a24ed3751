"""What the chaos runner records of each fault is what the invariants read.

A campaign died on seed 9 (a KeyError in the checks): the runner recorded a store failure
without its window, while the checks' tests wrote their actions by hand with it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from bench.chaos.invariants import check
from bench.chaos.plan import ChaosPlan
from bench.chaos.runner import ChaosRunner, StoreControl
from bench.chaos.schedule import ChaosFault, Schedule
from lab.live.event_log import LabEventLog
from tests.support.chaos_evidence import T0, _commit, _evidence, _resumed, _started
from training.records import EVENT, METRICS, STARTED


def _runner(tmp_path: Path, *faults: ChaosFault) -> ChaosRunner:
    def no_nodes(number: int) -> None:
        raise AssertionError("no node starts in this test")

    return ChaosRunner(
        ChaosPlan().scenario("runner"),
        [],
        no_nodes,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        LabEventLog(tmp_path / "lab-events.jsonl"),
        schedule=Schedule(0, faults),
        store=StoreControl(tmp_path / "control.jsonl", tmp_path / "store"),
    )


def test_store_and_etcd_faults_are_recorded_with_their_windows(tmp_path: Path) -> None:
    faults = (
        ChaosFault("store-fail", 0.0, seconds=11.0),
        ChaosFault("store-slow", 0.0, seconds=4.0, delay_s=0.5),
        ChaosFault("etcd", 0.0, seconds=2.0),
    )
    runner = _runner(tmp_path, *faults)
    for index, fault in enumerate(faults):
        runner._run(index, fault)
    recorded = [(a["kind"], a["seconds"], a["delay_s"]) for a in runner.actions]
    assert recorded == [("store-fail", 11.0, 0.0), ("store-slow", 4.0, 0.5), ("etcd", 2.0, 0.0)]


def test_the_checks_read_a_store_failure_as_the_runner_records_it(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    runner._run(0, ChaosFault("store-fail", 0.0, seconds=60.0))
    store_fail = {**runner.actions[0], "ts": T0 + 7.0}
    evidence = _evidence()
    records = [r for r in evidence.records if r.get("rdzv_round") != 2 or r["kind"] == METRICS]
    records += [_started(9, "node-2", 2), _resumed(10, "node-2", 2, 0, "fresh")]
    actions = [
        {"ts": T0 + 1.5, "kind": "warm", "nodes": []},
        {"ts": T0 + 7.5, "kind": "evict-all", "nodes": ["node-0", "node-1"]},
        store_fail,
    ]
    calls = {"node-0": _commit(3.0)}
    verdict, _ = check(replace(evidence, records=records, actions=actions, store_calls=calls))
    assert "left no room for a commit" in verdict.excused[0]["detail"]


class _Node:
    """A node that only records what the runner sent it."""

    def __init__(self, name: str) -> None:
        self.name, self.sent = name, []

    def freeze(self) -> None:
        self.sent.append("SIGSTOP")

    def thaw(self) -> None:
        self.sent.append("SIGCONT")

    def kill(self) -> None:
        self.sent.append("SIGKILL")


def test_a_thawed_node_comes_back_only_after_the_group_re_formed_without_it(
    tmp_path: Path,
) -> None:
    thaw = ChaosFault("thaw", 0.0, pick=0.9, seconds=0.0, thaw_s=0.0)
    runner = _runner(tmp_path, thaw)
    runner.nodes = {n: _Node(f"node-{n}") for n in range(3)}  # type: ignore[misc]
    runner.live = {0, 1, 2}
    runner._run(0, thaw)
    assert runner.nodes[2].sent == ["SIGSTOP"] and runner.live == {0, 1}
    runner._thaw_due(time.monotonic())
    assert runner.nodes[2].sent == ["SIGSTOP"]  # nothing re-formed yet
    # Its own old worker's line is no re-form; another node's worker starting after it is.
    runner._observe(2, {"kind": EVENT, "event": STARTED, "node": "node-2", "ts": time.time()})
    runner._thaw_due(time.monotonic())
    assert runner.nodes[2].sent == ["SIGSTOP"]
    runner._observe(0, {"kind": EVENT, "event": STARTED, "node": "node-0", "ts": time.time()})
    runner._thaw_due(time.monotonic())
    assert runner.nodes[2].sent == ["SIGSTOP", "SIGCONT"] and runner.live == {0, 1, 2}
    assert [(a["kind"], a["nodes"]) for a in runner.actions] == [
        ("thaw", ["node-2"]),
        ("thawed", ["node-2"]),
    ]
    assert runner.actions[-1]["reformed"] is True


def test_a_frozen_node_keeps_its_place_until_it_comes_back(tmp_path: Path) -> None:
    thaw = ChaosFault("thaw", 0.0, pick=0.0, seconds=0.0, thaw_s=0.0)
    join = ChaosFault("join", 0.0)
    runner = _runner(tmp_path, thaw, join)
    runner.nodes = {n: _Node(f"node-{n}") for n in range(3)}  # type: ignore[misc]
    runner.live = {0, 1, 2}
    runner._run(0, thaw)
    runner._run(1, join)  # the job's most (3) still counts the frozen node
    assert runner.actions[-1] == {**runner.actions[-1], "landed": False, "why": "max nodes run"}
    assert not runner._done_with_faults()
    runner._paused[0].give_up = 0.0  # no group re-formed: it comes back after the wait anyway
    runner._thaw_due(time.monotonic())
    assert runner.actions[-1]["kind"] == "thawed" and runner.actions[-1]["reformed"] is False


class _Network:
    """Records the cuts and heals the runner asks of the nodes' network."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def cut(self, node: str) -> None:
        self.calls.append(("cut", node))

    def heal(self, node: str) -> None:
        self.calls.append(("heal", node))

    def cut_from_host(self, node: str) -> None:
        self.calls.append(("cut etcd", node))

    def heal_host(self, node: str) -> None:
        self.calls.append(("heal etcd", node))


def test_a_partition_cuts_a_live_node_off_and_heals_it_after_its_seconds(tmp_path: Path) -> None:
    cut = ChaosFault("partition", 0.0, pick=0.5, seconds=30.0)
    again = ChaosFault("partition", 0.0, pick=0.5, seconds=0.0)
    runner = _runner(tmp_path, cut, again)
    runner.network = network = _Network()  # type: ignore[assignment]
    runner.nodes = {n: _Node(f"node-{n}") for n in range(3)}  # type: ignore[misc]
    runner.live = {0, 1, 2}
    runner._run(0, cut)
    # The node stays live, and nothing is sent to its processes.
    assert network.calls == [("cut", "node-1")] and runner.live == {0, 1, 2}
    assert runner.nodes[1].sent == []
    runner._index = 2
    runner._run(1, again)  # the same node again, shorter: it stays cut until the longer ends
    runner._heal_due(time.monotonic())
    assert network.calls == [("cut", "node-1"), ("cut", "node-1")]
    assert not runner._done_with_faults()
    runner._heal_due(time.monotonic(), every=True)  # training finished first
    assert network.calls[-1] == ("heal", "node-1") and runner._done_with_faults()
    assert [(a["kind"], a["index"], a["nodes"]) for a in runner.actions] == [
        ("partition", 0, ["node-1"]),
        ("partition", 1, ["node-1"]),
        ("healed", 1, ["node-1"]),
        ("healed", 0, ["node-1"]),
    ]
    assert runner.actions[-1]["early"] is True and runner.actions[0]["seconds"] == 30.0


def test_an_etcd_cut_takes_etcd_from_its_nodes_and_starts_a_new_one_beside_them(
    tmp_path: Path,
) -> None:
    cut = ChaosFault("etcd-cut", 0.0, pick=0.5, seconds=0.0, nodes=2, join=True)
    runner = _runner(tmp_path, cut)
    runner.network = network = _Network()  # type: ignore[assignment]
    runner.nodes = {n: _Node(f"node-{n}") for n in range(2)}  # type: ignore[misc]
    runner.live = {0, 1}
    started: list[int] = []

    def start(number: int) -> None:
        started.append(number)
        runner.nodes[number] = _Node(f"node-{number}")  # type: ignore[assignment]

    runner._start_node = start  # type: ignore[method-assign]
    runner._run(0, cut)
    # From the picked node on, in name order; both stay live and get no signal.
    assert network.calls == [("cut etcd", "node-1"), ("cut etcd", "node-0")]
    assert runner.live == {0, 1} and all(runner.nodes[n].sent == [] for n in (0, 1))
    assert started == [2]  # the new node, as they are cut
    action = runner.actions[-1]
    assert (action["nodes"], action["new"]) == (["node-1", "node-0"], "node-2")
    runner._heal_due(time.monotonic())
    assert network.calls[2:] == [("heal etcd", "node-1"), ("heal etcd", "node-0")]
    assert [a["kind"] for a in runner.actions] == ["etcd-cut", "healed", "healed"]


def test_a_partition_with_no_network_is_recorded_as_not_landed(tmp_path: Path) -> None:
    cut = ChaosFault("partition", 0.0, seconds=5.0)
    runner = _runner(tmp_path, cut)
    runner.nodes = {0: _Node("node-0")}  # type: ignore[misc]
    runner.live = {0}
    runner._run(0, cut)
    assert runner.actions[-1] | {"ts": 0} == {
        "ts": 0,
        "index": 0,
        "kind": "partition",
        "nodes": [],
        "landed": False,
        "why": "no network namespaces",
    }
