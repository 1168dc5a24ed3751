"""What the chaos runner records of each fault is what the invariants read.

A campaign died on seed 9 (a KeyError in the checks): the runner recorded a store failure
without its window, while the checks' tests wrote their actions by hand with it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.chaos.invariants import check
from bench.chaos.plan import ChaosPlan
from bench.chaos.runner import ChaosRunner, StoreControl
from bench.chaos.schedule import ChaosFault, Schedule
from lab.live.event_log import LabEventLog
from tests.bench.test_chaos_invariants import T0, _evidence, _resumed, _started


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
    records = [r for r in evidence.records if r.get("rdzv_round") != 2 or r["kind"] == "metrics"]
    records += [_started(9, "node-2", 2), _resumed(10, "node-2", 2, 0, "fresh")]
    actions = [
        {"ts": T0 + 1.5, "kind": "warm", "nodes": []},
        {"ts": T0 + 7.5, "kind": "evict-all", "nodes": ["node-0", "node-1"]},
        store_fail,
    ]
    verdict, _ = check(replace(evidence, records=records, actions=actions))
    assert "left no room for a commit" in verdict.excused[0]["detail"]
