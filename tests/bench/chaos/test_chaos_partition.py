"""The chaos checks on a partition, with evidence written by hand: a node cut off from its
peers gets no signal, so it is judged as a node the campaign never touched. Its steps count
(a loss of one is no excused loss), it must not train a group of its own while the others
train, and it may not end for good."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.chaos.invariants import Evidence, check, signals_by_node
from tests.support.chaos_evidence import (
    _action,
    _event,
    _local,
    _metrics,
    _node,
    _resumed,
    _started,
)
from training.records import FINISHED, STEP_COMPLETED


def _completed(ts: float, node: str, round_: int, step: int, world: int) -> dict[str, Any]:
    """A node that is not rank 0 logs each step it completed."""
    return {**_event(ts, STEP_COMPLETED, node, round_), "step": step, "world_size": world}


def _partitioned(**overrides: Any) -> Evidence:
    """Three nodes train round 1 (steps 1-5); node-2 is cut off at 7 s; node-0 and node-1
    train round 2 at world 2 (steps 6-10); the partition heals at 14 s and round 3 takes
    node-2 back at world 3 (steps 11-14)."""
    records = [
        *(_started(1, f"node-{i}", 1, i, 3) for i in range(3)),
        _resumed(2, "node-0", 1, 0, "fresh"),
        *(_metrics(2 + s, s, 1) for s in range(1, 6)),
        *(_completed(2 + s, "node-2", 1, s, 3) for s in range(1, 6)),
        *(_started(8, f"node-{i}", 2, i, 2) for i in range(2)),
        _resumed(8.5, "node-0", 2, 5, "local"),
        *(_metrics(8.5 + s, 5 + s, 2) for s in range(1, 6)),
        *(_started(15, f"node-{i}", 3, i, 3) for i in range(3)),
        _resumed(15.5, "node-0", 3, 10, "local"),
        *(_metrics(15.5 + s, 10 + s, 3) for s in range(1, 5)),
        {**_event(20, FINISHED, "node-0", 3), "step": 14},
    ]
    values: dict[str, Any] = {
        "records": records,
        "lab_events": [
            *(_node(0, "node_started", f"node-{i}") for i in range(3)),
            *(_node(21, "node_exited", f"node-{i}", code=0) for i in range(3)),
        ],
        "actions": [
            _action(1.5, "warm"),
            _action(7, "partition", "node-2", index=0, seconds=7.0),
            _action(14, "healed", "node-2", index=0, early=False),
        ],
        "final_codes": {f"node-{i}": 0 for i in range(3)},
        "agent_logs": {},
        "ack_checks": [],
        "newest_verified": 14,
        "parameter_difference": 0.0,
        "status": "finished",
        "max_steps": 14,
        "stop_deadline_s": 10.0,
    }
    values.update(overrides)
    return Evidence(**values)


def _violated(evidence: Evidence) -> set[str]:
    return {v["invariant"] for v in check(evidence)[0].violations}


def test_a_node_left_out_while_cut_off_and_back_after_the_heal_keeps_every_invariant() -> None:
    verdict, figures = check(_partitioned())
    assert verdict.violations == [] and verdict.excused == []
    assert figures["steps_lost"] == 0
    assert signals_by_node(_partitioned().actions) == {}  # a partition signals nobody


def test_a_cut_off_node_that_trains_a_group_of_its_own_meanwhile_is_split_brain() -> None:
    evidence = _partitioned()
    alone = [_started(9, "node-2", 9), *(_metrics(9.5 + s, 5 + s, 9, "node-2") for s in (1, 2))]
    assert _violated(replace(evidence, records=[*evidence.records, *alone])) == {"one group"}


def test_a_step_the_cut_off_node_completed_in_its_group_is_not_excused_when_lost() -> None:
    # node-2 completed step 6 with the group just before the cut (rank 0's line for it never
    # came); round 2 resumed at 5. A partition is no loss of the node: not excused.
    evidence = _partitioned()
    records = [*evidence.records, _completed(7.0, "node-2", 1, 6, 3)]
    verdict, figures = check(replace(evidence, records=records))
    assert [v["invariant"] for v in verdict.violations] == ["no lost step"]
    assert "held by node-0, node-1, node-2" in verdict.violations[0]["detail"]
    assert verdict.excused == [] and figures["steps_lost"] == 1


def test_a_cut_off_node_may_be_restarted_by_a_new_pod_but_never_end_for_good() -> None:
    # A partition longer than the join timeout: the round it waits for never completes, the
    # agent ends 138 and a new pod takes its place. That is retried, not the job's end.
    timeout = "2027-01-15 08:00:13,000 round 2 did not complete within 60 s"
    evidence = _partitioned()
    lab_events = [
        *evidence.lab_events[:3],
        _node(13.5, "node_exited", "node-2", code=138),
        _node(14.5, "node_started", "node-2"),
        *evidence.lab_events[3:],
    ]
    retried = replace(evidence, lab_events=lab_events, agent_logs={"node-2": _local(timeout)})
    assert _violated(retried) == set()
    # One that says its workers failed for good ends the job's chances: caught.
    for_good = "2027-01-15 08:00:13,000 the workers failed (exit codes [1]) and no restart fixed it"
    ended = [e if e.get("code") != 138 else {**e, "code": 1} for e in lab_events]
    crashed = replace(evidence, lab_events=ended, agent_logs={"node-2": _local(for_good)})
    assert _violated(crashed) == {"finished"}
