"""The chaos campaign's checks, on evidence written by hand: each invariant can fail, and an
excused loss says why."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.chaos.endings import AGENT_SAYS, ending, exit_code
from bench.chaos.invariants import Evidence, check
from bench.chaos.store_excuse import store_refused
from tests.support.chaos_evidence import (
    T0,
    _action,
    _call,
    _commit,
    _event,
    _evidence,
    _local,
    _metrics,
    _node,
    _resumed,
    _started,
)
from training.elastic.exit_codes import ENDINGS
from training.records import EMERGENCY_SAVE, METRICS, RESUMED, STARTED, STEP_COMPLETED

REPO = Path(__file__).resolve().parents[3]


def _violated(evidence: Evidence) -> set[str]:
    return {v["invariant"] for v in check(evidence)[0].violations}


def test_a_clean_schedule_keeps_every_invariant() -> None:
    verdict, figures = check(_evidence())
    assert verdict.violations == [] and verdict.excused == []
    assert figures["steps_lost"] == 0 and figures["worst_pause_s"] == 4.0


def test_a_resume_behind_a_step_a_survivor_held_is_a_lost_step() -> None:
    evidence = _evidence()
    records = [
        {**r, "step": 3} if r.get("event") == RESUMED and r["rdzv_round"] == 2 else r
        for r in evidence.records
    ]
    verdict, figures = check(replace(evidence, records=records))
    assert [v["invariant"] for v in verdict.violations] == ["no lost step"]
    assert "held by node-0" in verdict.violations[0]["detail"]  # node-1 was killed
    assert figures["steps_lost"] == 2


def test_a_step_only_a_node_without_rank_0_logged_counts_when_the_next_round_resumes() -> None:
    # node-1 (not rank 0) completed step 6 just before it was killed; rank 0's node-0 logged
    # only step 5 (its metrics line for 6 never came). The round after resumed at 5: node-0,
    # alive, held step 6 too, so a step was lost, and only node-1's own log shows it.
    evidence = _evidence()
    completed = {**_event(7.2, STEP_COMPLETED, "node-1", 1), "step": 6, "world_size": 2}
    verdict, figures = check(replace(evidence, records=[*evidence.records, completed]))
    assert [v["invariant"] for v in verdict.violations] == ["no lost step"]
    assert "after step 6 was completed; held by node-0" in verdict.violations[0]["detail"]
    assert figures["steps_lost"] == 1


def test_a_loss_when_every_holder_was_killed_without_notice_is_excused_and_says_so() -> None:
    evidence = _evidence()
    records = [r for r in evidence.records if r.get("rdzv_round") != 2 or r["kind"] == METRICS]
    records += [_started(9, "node-2", 2), _resumed(10, "node-2", 2, 0, "fresh")]
    actions = [
        _action(1.5, "warm"),
        _action(7.5, "kill", "node-1"),
        _action(7.6, "freeze", "node-0"),
    ]
    verdict, _ = check(replace(evidence, records=records, actions=actions))
    assert "no lost step" not in {v["invariant"] for v in verdict.violations}
    (excused,) = verdict.excused
    assert "node-1 got SIGKILL with no notice" in excused["detail"]
    assert "node-0 got SIGSTOP with no notice" in excused["detail"]


def test_a_node_whose_own_save_stopped_before_the_step_did_not_hold_it() -> None:
    # Seeds 5 and 28 of a campaign: under DDP one node's ranks may apply a step whose
    # all-reduce another node's, stopped in it, never finished. node-1 completed step 6 and was
    # then frozen; node-0's own save on its stop says it had step 5. The next round resumed at
    # 5: every node that held step 6 was lost, which is excused, and node-0 held none of it.
    evidence = _evidence()
    completed = {**_event(7.2, STEP_COMPLETED, "node-1", 1), "step": 6, "world_size": 2}
    saved = {**_event(7.3, EMERGENCY_SAVE, "node-0", 1), "step": 5, "reason": "sigterm"}
    actions = [_action(1.5, "warm"), _action(7.5, "freeze", "node-1")]
    records = [*evidence.records, completed, saved]
    verdict, figures = check(replace(evidence, records=records, actions=actions))
    assert "no lost step" not in {v["invariant"] for v in verdict.violations}
    (excused,) = verdict.excused
    assert "after step 6 was completed" in excused["detail"]
    assert "node-1 got SIGSTOP with no notice" in excused["detail"]
    assert "node-0" not in excused["detail"]
    assert figures["steps_lost"] == 1


def _lost_to_eviction(**overrides: Any) -> Evidence:
    """Both nodes evicted at 7.5 s, the next round starts fresh: a loss, unless excused."""
    evidence = _evidence()
    records = [r for r in evidence.records if r.get("rdzv_round") != 2 or r["kind"] == METRICS]
    records += [_started(9, "node-2", 2), _resumed(10, "node-2", 2, 0, "fresh")]
    evicted = [_action(1.5, "warm"), _action(7.5, "evict-all", "node-0", "node-1")]
    values = {"records": records, "actions": evicted, "store_calls": {"node-0": _commit(3.0)}}
    return replace(evidence, **(values | overrides))


def test_an_eviction_is_notice_unless_the_store_refused_the_whole_deadline() -> None:
    lost = _lost_to_eviction()
    assert "no lost step" in _violated(lost)
    failing = [_call(8 + i, "list", 0.01, fail=True, outcome="failed") for i in range(9)]
    refused = [*lost.actions, _action(7.0, "store-fail", seconds=11.0)]
    calls = {"node-0": [*_commit(3.0), *failing]}
    verdict, _ = check(replace(lost, actions=refused, store_calls=calls))
    assert "left no room for a commit" in verdict.excused[0]["detail"]
    assert "no lost step" not in {v["invariant"] for v in verdict.violations}


def test_a_store_measured_too_slow_between_its_failures_excuses_the_loss_and_no_less() -> None:
    # Seed 9: reads slowed 1.2 s each while the store failed twice in the 10 s deadline; the
    # stretches between the failures (2 s each) were shorter than a commit at the measured speed.
    lost = _lost_to_eviction()
    fails = [
        _action(9.6, "store-fail", seconds=1.4, delay_s=0.0),
        _action(13.1, "store-fail", seconds=4.9, delay_s=0.0),
    ]
    slow = [
        _call(ts, op, 1.2, delay_s=1.2)
        for ts in (7.6, 8.8, 12.0, 18.5, 19.7, 20.9)
        for op in ("list", "get")
    ]
    calls = {"node-0": [*_commit(3.0), *slow]}
    verdict, _ = check(replace(lost, actions=[*lost.actions, *fails], store_calls=calls))
    assert "left no room for a commit" in verdict.excused[0]["detail"]
    assert "no lost step" not in {v["invariant"] for v in verdict.violations}
    # The same failures with the store measured at full speed between them: a commit fitted.
    assert "no lost step" in _violated(replace(lost, actions=[*lost.actions, *fails]))
    # Slowed alone, with no failure: a commit of 4 calls at 1.2 s each fits in 10 s.
    assert "no lost step" in _violated(replace(lost, store_calls=calls))


def _agent_commit_after_an_outage(fails_late: bool = True) -> list[dict[str, Any]]:
    """Seed 139's evicted nodes (times from the schedule's logs): the agent's commit opens the
    store while it fails (the last failing read slowed 1.42 s), retries after its pause, and
    reads the lineage, the manifests' listing, a look past its end and the head, each 1.42 s
    late, until its deadline."""
    slow = {"delay_s": 1.42}
    lineage = {"name": "ckpt-lineage.json"}
    failed = {"fail": True, "outcome": "failed"}
    calls = [_call(ts, "get", 0.0001, **lineage, **failed) for ts in (7.5, 7.6, 7.8, 8.2, 9.0)]
    took = 1.42 if fails_late else 0.0001
    calls.append(_call(10.03, "get", took, **lineage, **failed, **(slow if fails_late else {})))
    start = 10.03 + took + 1.0
    calls += [
        _call(start, "get", 1.42, **lineage, **slow),
        _call(start + 1.42, "list", 1.42, **slow),
        _call(start + 2.84, "get", 1.42, **slow, outcome="FileNotFoundError"),
        _call(start + 4.26, "get", 0.78, **slow, outcome="timed out"),
    ]
    return calls


def test_an_agents_commit_is_weighed_with_its_own_reads_and_the_outage_as_measured() -> None:
    # Seed 139: every node evicted (10 s deadline) while the store failed, then answered each
    # read 1.42 s late. The stretch after the outage, as the rule saw it (the outage's end and
    # the retry's pause: 6.05 s), would hold a worker's commit (a listing and two reads late:
    # 4.27 s); but the outage's last read failed 1.42 s late, and an agent reads the lineage
    # first: 5.05 s left for 5.69 s.
    lost = _lost_to_eviction()
    outage = [*lost.actions, _action(5.2, "store-fail", seconds=5.25)]
    healthy = [
        _call(3.0 + i * 0.001, op, 0.001) for i, op in enumerate(("list", "get", "get", "put"))
    ]
    healthy.append(_call(3.004, "put_new", 0.001))

    def verdict(node_0: list[dict[str, Any]]) -> set[str]:
        calls = {"node-0": [*healthy, *node_0], "node-1": node_0}
        return _violated(replace(lost, actions=outage, store_calls=calls))

    assert "no lost step" not in verdict(_agent_commit_after_an_outage())
    # The outage's last failure came back at once: the stretch holds the agent's commit.
    assert "no lost step" in verdict(_agent_commit_after_an_outage(fails_late=False))
    # No lineage read measured (a worker commits): its commit fits the shorter stretch.
    worker = [
        {**c, "name": "ckpt-manifest-1"} if "lineage" in c["name"] else c
        for c in _agent_commit_after_an_outage()
    ]
    assert "no lost step" in verdict(worker)


def test_slow_calls_no_fault_injected_excuse_no_loss() -> None:
    # A regression: under a healthy store every call takes seconds. Nothing the bench injected
    # slowed them, so the loss is the job's, whatever the calls measured.
    lost = _lost_to_eviction()
    slow = [_call(7.6 + 2.4 * i, "put", 2.4) for i in range(4)]
    calls = {"node-0": [*_commit(3.0, took=2.0), *slow]}
    assert "no lost step" in _violated(replace(lost, store_calls=calls))
    # Commits so slow that a healthy one misses the deadline are no excuse even with the
    # store failing for part of it.
    failing = [_action(12.0, "store-fail", seconds=2.0)]
    calls = {"node-0": [*_commit(3.0, took=11.0), *slow]}
    both = replace(lost, actions=[*lost.actions, *failing], store_calls=calls)
    assert "no lost step" in _violated(both)


def test_the_store_excuse_reads_only_what_was_measured() -> None:
    start, end = T0 + 10, T0 + 20
    fail_all = [_action(9.0, "store-fail", seconds=12.0)]
    healthy = {"node-0": _commit(3.0, took=0.4)}
    assert store_refused(start, end, fail_all, healthy)[0]
    # No commit was measured healthy in the schedule: nothing to weigh the deadline against.
    assert store_refused(start, end, fail_all, {}) == (
        False,
        "no healthy commit measured in this schedule",
    )
    # A commit whose calls met trouble is not a healthy commit.
    troubled = [{**c, "delay_s": 0.5} for c in _commit(3.0)]
    assert store_refused(start, end, fail_all, {"node-0": troubled})[0] is False
    # The failure ends with a stretch of 8 s left (after the retry's pause): room for a commit.
    short = [_action(9.0, "store-fail", seconds=2.0)]
    assert store_refused(start, end, short, healthy)[0] is False
    # ... unless the calls measured then were slowed past what that stretch holds.
    slowed = [_call(13.0 + 2.5 * i, op, 2.5, delay_s=2.5) for i, op in enumerate(("get", "put"))]
    slowed += [_call(13.0, op, 2.5, delay_s=2.5) for op in ("list", "put_new")]
    assert store_refused(start, end, short, {"node-0": [*_commit(3.0), *slowed]})[0]


def test_two_rounds_training_at_once_is_split_brain() -> None:
    evidence = _evidence()
    records = [*evidence.records, _metrics(12.5, 7, 1, "node-1")]
    assert "one group" in _violated(replace(evidence, records=records))


def test_an_acknowledged_step_the_store_does_not_hold_is_caught() -> None:
    behind = [{"ts": T0 + 5, "node": "node-0", "acked": 5, "verified": 4}]
    assert _violated(_evidence(ack_checks=behind)) == {"durable not behind"}
    assert _violated(_evidence(newest_verified=9)) == {"durable not behind"}


def test_parameters_off_the_reference_trajectory_are_caught() -> None:
    assert _violated(_evidence(parameter_difference=1e-3)) == {"trajectory"}


def test_a_run_that_did_not_finish_is_caught() -> None:
    assert "finished" in _violated(_evidence(status="timeout"))


def test_exit_codes_follow_the_table_for_each_ending() -> None:
    log = "2027-01-15 08:00:13,000 the workers failed (exit codes [1]) and no restart fixed it"
    stamp = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC; the log is read in local time
    assert stamp == T0
    lab_events = [
        _node(0, "node_started", "node-0"),
        _node(0, "node_started", "node-1"),
        _node(17, "node_exited", "node-0", code=0),
    ]
    # An evicted node must exit 143; a SIGKILL after its grace is 137.
    evicted = _evidence(actions=[_action(1.5, "warm"), _action(7.5, "evict", "node-1")])
    assert "exit codes" not in _violated(replace(evicted, final_codes={"node-0": 0, "node-1": 143}))
    assert "exit codes" not in _violated(replace(evicted, final_codes={"node-0": 0, "node-1": -9}))
    assert "exit codes" in _violated(replace(evicted, final_codes={"node-0": 0, "node-1": 1}))
    # A node nobody signalled that ends for good fails the job.
    crashed = _evidence(
        lab_events=[*lab_events, _node(13.5, "node_exited", "node-1", code=1)],
        actions=[_action(1.5, "warm")],
        agent_logs={"node-1": _local(log)},
    )
    assert _violated(crashed) == {"finished"}
    silent = replace(crashed, agent_logs={})
    assert "exit codes" in _violated(silent)


def test_a_node_that_finds_the_run_over_is_no_failure_but_one_before_the_end_is() -> None:
    closed = "2027-01-15 08:00:13,000 the rendezvous is closed for this id (the run finished)"
    late = _evidence(
        lab_events=[
            _node(0, "node_started", "node-0"),
            _node(0, "node_started", "node-1"),
            _node(15.5, "node_started", "node-2"),
            _node(17, "node_exited", "node-0", code=0),
            _node(17, "node_exited", "node-2", code=1),
        ],
        final_codes={"node-0": 0, "node-1": -9, "node-2": 1},
        agent_logs={"node-2": _local(closed, 16.5)},
    )
    assert _violated(late) == set()
    early = replace(
        late,
        lab_events=[*late.lab_events[:2], _node(12, "node_started", "node-2")]
        + [
            _node(17, "node_exited", "node-0", code=0),
            _node(13.5, "node_exited", "node-2", code=1),
        ],
        agent_logs={"node-2": _local(closed, 13)},
    )
    assert _violated(early) == {"finished"}


def test_every_ending_the_checks_read_is_one_the_agent_logs_and_the_table_holds() -> None:
    # The messages as logged: adjacent string literals joined, the signal's number left out.
    texts = [
        (REPO / "training" / name).read_text() for name in ("agent.py", "elastic/rendezvous.py")
    ]
    source = re.sub(r'"\s*\n\s*f?"', "", "".join(texts))
    for phrase, how in AGENT_SAYS:
        words = phrase.replace(" 15:", "").replace(" 2:", "")
        assert words in source, phrase
        assert ending(how) in ENDINGS
    assert exit_code(-9) == 137 and exit_code(143) == 143


def test_a_thawed_node_is_judged_by_what_it_did_after_it_came_back() -> None:
    # node-1 was frozen at 7.5 s and thawed at 12 s: it rejoined and finished with the job.
    lab_events = [
        _node(0, "node_started", "node-0"),
        _node(0, "node_started", "node-1"),
        _node(17, "node_exited", "node-0", code=0),
        _node(17, "node_exited", "node-1", code=0),
    ]
    thawed = _evidence(
        lab_events=lab_events,
        actions=[
            _action(1.5, "warm"),
            _action(7.5, "thaw", "node-1"),
            _action(12.0, "thawed", "node-1", reformed=True),
        ],
        final_codes={"node-0": 0, "node-1": 0},
    )
    assert _violated(thawed) == set()
    # Had it not come back, only a SIGKILL could end it.
    frozen = replace(thawed, actions=thawed.actions[:2])
    assert _violated(frozen) == {"exit codes"}
    # Back, it must end as the table says for what it reports, and not for good mid-run.
    closed = "2027-01-15 08:00:13,000 the rendezvous is closed for this id (the run failed)"
    failed = replace(
        thawed,
        lab_events=[*lab_events[:3], _node(13.5, "node_exited", "node-1", code=1)],
        final_codes={"node-0": 0, "node-1": 1},
        agent_logs={"node-1": _local(closed)},
    )
    assert _violated(failed) == {"finished"}
    left = "2027-01-15 08:00:13,000 this node left the rendezvous (its peers re-formed)"
    gone = replace(failed, agent_logs={"node-1": _local(left)})
    assert _violated(gone) == {"exit codes"}  # the table gives 138, not 1
    retried = replace(
        gone,
        lab_events=[*lab_events[:3], _node(13.5, "node_exited", "node-1", code=138)],
        final_codes={"node-0": 0, "node-1": 138},
    )
    assert _violated(retried) == set()
    # Frozen again after it came back, and never thawed: SIGKILL's code again.
    again = replace(thawed, actions=[*thawed.actions, _action(14.0, "freeze", "node-1")])
    assert _violated(again) == {"exit codes"}
    killed = replace(again, lab_events=lab_events[:3], final_codes={"node-0": 0, "node-1": -9})
    assert _violated(killed) == set()


def test_a_late_upload_that_moves_the_durable_head_back_is_caught() -> None:
    checks = [
        {"ts": T0 + 5, "node": "node-0", "acked": 5, "verified": 5},
        {"ts": T0 + 9, "node": "node-1", "acked": 3, "verified": 3},  # a zombie's manifest
        {"ts": T0 + 15, "node": "node-0", "acked": 10, "verified": 10},
    ]
    verdict, _ = check(_evidence(ack_checks=checks))
    assert [v["invariant"] for v in verdict.violations] == ["durable not behind"]
    assert "went back from step 5" in verdict.violations[0]["detail"]
    # A late acknowledgement of an older step with the head kept is fine.
    kept = [checks[0], {**checks[1], "verified": 5}, checks[2]]
    assert _violated(_evidence(ack_checks=kept)) == set()


def test_every_round_that_trained_had_its_whole_world_node_by_node() -> None:
    # Two nodes of 2 processes in round 1 (ranks 0-3), node-0 alone in round 2 (ranks 0-1).
    evidence = _evidence(nproc_per_node=2)
    records = [r for r in evidence.records if r.get("event") != STARTED]
    started = [
        *(_started(1, "node-0", 1, rank, 4, 2) for rank in (0, 1)),
        *(_started(1, "node-1", 1, rank, 4, 2) for rank in (2, 3)),
        *(_started(9, "node-0", 2, rank, 2, 2) for rank in (0, 1)),
    ]
    assert _violated(replace(evidence, records=[*records, *started])) == set()
    # A rank missing from a round that trained: its world was not all there.
    missing = [r for r in started if not (r["rdzv_round"] == 1 and r["rank"] == 3)]
    assert _violated(replace(evidence, records=[*records, *missing])) == {"ranks"}
    # Both processes of node-1 said local rank 0.
    twice = [{**r, "local_rank": 0} if r["rank"] == 3 else r for r in started]
    assert _violated(replace(evidence, records=[*records, *twice])) == {"ranks"}
    # One process a node where the schedule ran two.
    assert _violated(replace(evidence, nproc_per_node=1, records=[*records, *started])) == {"ranks"}
