"""The chaos campaign's checks, on evidence written by hand: each invariant can fail, and an
excused loss says why."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.chaos.endings import AGENT_SAYS, ending, exit_code
from bench.chaos.invariants import Evidence, check
from training.elastic.exit_codes import ENDINGS

REPO = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0


def _metrics(ts: float, step: int, round_: int, node: str = "node-0") -> dict[str, Any]:
    return {"ts": T0 + ts, "kind": "metrics", "step": step, "rdzv_round": round_, "node": node}


def _event(ts: float, name: str, node: str, round_: int, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + ts, "kind": "event", "event": name, "node": node, "rdzv_round": round_}


def _started(ts: float, node: str, round_: int) -> dict[str, Any]:
    return _event(ts, "started", node, round_)


def _resumed(ts: float, node: str, round_: int, step: int, source: str) -> dict[str, Any]:
    return {**_event(ts, "resumed", node, round_), "step": step, "source": source}


def _node(ts: float, event: str, node: str, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + ts, "event": event, "node": node, **fields}


def _action(ts: float, kind: str, *nodes: str, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + ts, "kind": kind, "nodes": list(nodes), **fields}


def _evidence(**overrides: Any) -> Evidence:
    """Two nodes train rounds 1 (steps 1-5) and, after node-1 is lost, 2 at world 1."""
    records = [
        _started(1, "node-0", 1),
        _started(1, "node-1", 1),
        _resumed(2, "node-0", 1, 0, "fresh"),
        *(_metrics(2 + s, s, 1) for s in range(1, 6)),
        _started(9, "node-0", 2),
        _resumed(10, "node-0", 2, 5, "local"),
        *(_metrics(10 + s, 5 + s, 2) for s in range(1, 6)),
        {**_event(16, "finished", "node-0", 2), "step": 10},
    ]
    values: dict[str, Any] = {
        "records": records,
        "lab_events": [
            _node(0, "node_started", "node-0"),
            _node(0, "node_started", "node-1"),
            _node(17, "node_exited", "node-0", code=0),
        ],
        "actions": [_action(1.5, "warm"), _action(7.5, "kill", "node-1")],
        "final_codes": {"node-0": 0, "node-1": -9},
        "agent_logs": {},
        "ack_checks": [],
        "newest_verified": 10,
        "parameter_difference": 0.0,
        "status": "finished",
        "max_steps": 10,
        "stop_deadline_s": 10.0,
    }
    values.update(overrides)
    return Evidence(**values)


def _violated(evidence: Evidence) -> set[str]:
    return {v["invariant"] for v in check(evidence)[0].violations}


def test_a_clean_schedule_keeps_every_invariant() -> None:
    verdict, figures = check(_evidence())
    assert verdict.violations == [] and verdict.excused == []
    assert figures["steps_lost"] == 0 and figures["worst_pause_s"] == 4.0


def test_a_resume_behind_a_step_a_survivor_held_is_a_lost_step() -> None:
    evidence = _evidence()
    records = [
        {**r, "step": 3} if r.get("event") == "resumed" and r["rdzv_round"] == 2 else r
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
    completed = {**_event(7.2, "step_completed", "node-1", 1), "step": 6, "world_size": 2}
    verdict, figures = check(replace(evidence, records=[*evidence.records, completed]))
    assert [v["invariant"] for v in verdict.violations] == ["no lost step"]
    assert "after step 6 was completed; held by node-0" in verdict.violations[0]["detail"]
    assert figures["steps_lost"] == 1


def test_a_loss_when_every_holder_was_killed_without_notice_is_excused_and_says_so() -> None:
    evidence = _evidence()
    records = [r for r in evidence.records if r.get("rdzv_round") != 2 or r["kind"] == "metrics"]
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


def test_an_eviction_is_notice_unless_the_store_refused_the_whole_deadline() -> None:
    evidence = _evidence()
    records = [r for r in evidence.records if r.get("rdzv_round") != 2 or r["kind"] == "metrics"]
    records += [_started(9, "node-2", 2), _resumed(10, "node-2", 2, 0, "fresh")]
    evicted = [_action(1.5, "warm"), _action(7.5, "evict-all", "node-0", "node-1")]
    assert "no lost step" in _violated(replace(evidence, records=records, actions=evicted))
    refused = [*evicted, _action(7.0, "store-fail", seconds=11.0)]
    verdict, _ = check(replace(evidence, records=records, actions=refused))
    assert "left no room for a commit" in verdict.excused[0]["detail"]


def test_a_store_too_slow_between_its_failures_for_a_commit_excuses_the_loss_and_no_less() -> None:
    # Seed 9: reads slowed 1.2 s each while the store failed twice in the 10 s deadline; the
    # stretches between the failures (2 s each) were shorter than a commit at that speed.
    evidence = _evidence()
    records = [r for r in evidence.records if r.get("rdzv_round") != 2 or r["kind"] == "metrics"]
    records += [_started(9, "node-2", 2), _resumed(10, "node-2", 2, 0, "fresh")]
    evicted = [_action(1.5, "warm"), _action(7.5, "evict-all", "node-0", "node-1")]
    slow_reads = _action(7.0, "sigterm-restore", armed=True, seconds=12.0, delay_s=1.2)
    fails = [
        _action(9.6, "store-fail", seconds=1.4, delay_s=0.0),
        _action(13.1, "store-fail", seconds=4.9, delay_s=0.0),
    ]
    verdict, _ = check(replace(evidence, records=records, actions=[*evicted, slow_reads, *fails]))
    assert "left no room for a commit" in verdict.excused[0]["detail"]
    assert "no lost step" not in {v["invariant"] for v in verdict.violations}
    # The same failures with the store at full speed between them: a commit fitted.
    fast = [*evicted, *fails]
    assert "no lost step" in _violated(replace(evidence, records=records, actions=fast))
    # Slowed alone, with no failure: a commit of 5 slow calls fits in 10 s.
    assert "no lost step" in _violated(
        replace(evidence, records=records, actions=[*evicted, slow_reads])
    )


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


def _local(line: str, at: float = 13) -> str:
    """``line`` stamped ``at`` s after T0, in the local time the agent's log uses."""
    import time

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0 + at))
    return re.sub(r"^\S+ \S+,", stamp + ",", line)


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
