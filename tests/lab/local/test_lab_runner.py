"""The runner against fake nodes: which signal each fault sends, in which order, and how
the run ends. A fake job stands in for torchrun: the lowest-numbered running node is rank
0 and logs one metrics line per poll; a membership change logs a ``resumed`` event."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lab.local.run_extension import MIN_MARGIN_STEPS, StepRate, extended_end, margin_steps
from lab.local.scenario import Fault, TrainSettings
from lab.report.node_logs import read_jsonl
from tests.support.fake_lab import FakeNode, _runner, _scenario
from training.elastic.launch import RendezvousSettings


def test_every_fault_kind_sends_its_signal_in_order(tmp_path: Path) -> None:
    scenario = _scenario(
        Fault("evict", node=2, at_step=10, grace_s=0.0),
        Fault("join", at_step=20),
        Fault("kill", node=0, at_step=30),
        Fault("freeze", node=1, at_step=40),
        Fault("join", at_step=50),
        Fault("etcd-restart", at_step=60, down_s=1.5, wipe_data=True),
        Fault("kill-all", nodes=2, at_step=70),
    )
    runner, job = _runner(tmp_path, scenario)
    outcome = runner.run()
    assert outcome.status == "finished", outcome.message
    assert outcome.injected == 7
    faults = [c for c in job.calls if c[0] != "start" or c[1] not in ("node-0", "node-1", "node-2")]
    assert faults == [
        ("sigterm", "node-2"),
        ("kill", "node-2"),  # the notice, then SIGKILL after grace
        ("start", "node-3"),  # join: a node number that never took part
        ("kill", "node-0"),
        ("freeze", "node-1"),
        ("kill", "node-1"),  # the vanished VM is removed once the job settled without it
        ("start", "node-4"),
        ("etcd-restart", "down=1.5 wipe=True"),
        ("kill", "node-3"),
        ("kill", "node-4"),
        ("start", "node-5"),
        ("start", "node-6"),
    ]
    injected = [
        e for e in read_jsonl(tmp_path / "lab-events.jsonl") if e["event"] == "fault_injected"
    ]
    assert [e["planned_world_size"] for e in injected] == [2, 3, 2, 1, 2, 2, 2]
    assert injected[6]["stopped"] == ["node-3", "node-4"]
    assert injected[6]["started"] == ["node-5", "node-6"]
    pairs = zip(injected, scenario.faults, strict=True)
    assert all(e["step_at_injection"] >= f.at_step for e, f in pairs)


def test_a_fault_waits_until_the_previous_one_settled(tmp_path: Path) -> None:
    scenario = _scenario(Fault("kill", node=2, at_step=5), Fault("kill", node=1, at_step=5))
    runner, _ = _runner(tmp_path, scenario)
    assert runner.run().status == "finished"
    events = read_jsonl(tmp_path / "lab-events.jsonl")
    order = [e["event"] for e in events if e["event"].startswith("fault_")]
    assert order == ["fault_injected", "fault_settled", "fault_injected", "fault_settled"]


def test_at_time_trigger(tmp_path: Path) -> None:
    runner, job = _runner(tmp_path, _scenario(Fault("kill", node=2, at_time=3.0)))
    assert runner.run().status == "finished"
    injected = next(
        e for e in read_jsonl(tmp_path / "lab-events.jsonl") if e["event"] == "fault_injected"
    )
    assert injected["injected_at"] >= 3.0


def test_a_node_that_fails_on_its_own_restarts_in_place(tmp_path: Path) -> None:
    runner, job = _runner(tmp_path, _scenario())
    original_tick = job.tick

    def tick_and_fail_once() -> None:
        original_tick()
        if job.step == 20 and job.nodes[1].starts == 1 and job.nodes[1].running:
            job.nodes[1].exit(1)  # e.g. the agent lost etcd

    job.tick = tick_and_fail_once
    assert runner.run().status == "finished"
    assert job.nodes[1].starts == 2
    assert [
        e["node"]
        for e in read_jsonl(tmp_path / "lab-events.jsonl")
        if e["event"] == "node_restarted"
    ] == ["node-1"]


def test_restart_policy_never_leaves_a_failed_node_down(tmp_path: Path) -> None:
    runner, job = _runner(tmp_path, _scenario(restart_policy="Never"))
    original_tick = job.tick

    def tick_and_fail() -> None:
        original_tick()
        if job.step == 20 and job.nodes[2].running:
            job.nodes[2].exit(1)

    job.tick = tick_and_fail
    assert runner.run().status == "finished"
    assert job.nodes[2].starts == 1


@pytest.mark.parametrize(
    ("code", "stderr", "expected"),
    [
        (2, "error: --data-dir missing", "code 2 (bad input)"),
        (1, "torch...RendezvousClosedError", "rendezvous is closed"),
    ],
)
def test_fatal_node_exits_fail_the_run(
    tmp_path: Path, code: int, stderr: str, expected: str
) -> None:
    runner, job = _runner(tmp_path, _scenario())
    original_tick = job.tick

    def tick_and_fail() -> None:
        original_tick()
        if job.step == 5 and job.nodes[0].running:
            job.nodes[0].stderr_path.write_text(stderr)
            job.nodes[0].exit(code)

    job.tick = tick_and_fail
    outcome = runner.run()
    assert outcome.status == "failed"
    assert expected in outcome.message and stderr in outcome.message


def test_every_node_gone_fails_the_run(tmp_path: Path) -> None:
    runner, job = _runner(tmp_path, _scenario(nodes=1, restart_policy="Never"))
    original_tick = job.tick

    def tick_and_fail() -> None:
        original_tick()
        if job.step == 3:
            job.nodes[0].exit(1)

    job.tick = tick_and_fail
    outcome = runner.run()
    assert (outcome.status, outcome.message) == (
        "failed",
        "every node exited before training finished",
    )


def test_timeout(tmp_path: Path) -> None:
    runner, job = _runner(tmp_path, _scenario(timeout_s=0.2))
    job.tick = lambda: None  # the job never trains
    assert runner.run().status == "timeout"


def test_an_agent_that_lingers_after_the_end_is_logged_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, _ = _runner(tmp_path, _scenario(nodes=2))
    runner.finish_grace_s = 0.2
    original_exit = FakeNode.exit

    def stuck_in_exit_barrier(node: FakeNode, code: int) -> None:
        if not (node.number == 1 and code == 0):
            original_exit(node, code)

    monkeypatch.setattr(FakeNode, "exit", stuck_in_exit_barrier)
    assert runner.run().status == "finished"
    events = read_jsonl(tmp_path / "lab-events.jsonl")
    assert [e["node"] for e in events if e["event"] == "node_lingered"] == ["node-1"]


@dataclasses.dataclass
class SlowStarter(FakeNode):
    """A node started on a loaded machine: silent, not training, until ``silent_polls`` polls
    after the training finished; then it says its first line, finds the run over and exits 0
    two polls later."""

    silent_polls: int = 10
    polls_after_end: int = 0

    def say_first_word(self) -> None:
        pass

    def trains(self) -> bool:
        return False

    def poll(self) -> int | None:
        if self.job.step < self.job.max_steps:
            return super().poll()
        self.polls_after_end += 1
        if self.polls_after_end == self.silent_polls:
            super().say_first_word()
        elif self.polls_after_end == self.silent_polls + 2:
            self.exit(0)
        return None if self.running else self.code


def test_a_node_still_starting_at_the_end_gets_its_grace_from_its_first_line(
    tmp_path: Path,
) -> None:
    runner, job = _runner(tmp_path, _scenario(nodes=2))
    runner.finish_grace_s = 0.2  # the runner's polls every 50 ms make 10 silent polls longer

    def make_node(number: int) -> FakeNode:
        kind = SlowStarter if number == 1 else FakeNode
        job.nodes[number] = kind(job, number)
        return job.nodes[number]

    runner.make_node = make_node
    assert runner.run().status == "finished"
    slow = job.nodes[1]
    assert isinstance(slow, SlowStarter) and slow.polls_after_end >= slow.silent_polls + 2
    events = read_jsonl(tmp_path / "lab-events.jsonl")
    assert not [e for e in events if e["event"] == "node_lingered"]
    exited = {e["node"]: e["code"] for e in events if e["event"] == "node_exited"}
    assert exited == {"node-0": 0, "node-1": 0}


def test_an_etcd_restart_settles_only_after_the_keep_alive_bound_without_a_resume(
    tmp_path: Path,
) -> None:
    # The fake agents ride the restart out: no round resumes, lines keep coming at once.
    runner, _ = _runner(tmp_path, _scenario(Fault("etcd-restart", at_step=10)))
    assert runner.run().status == "finished"
    events = read_jsonl(tmp_path / "lab-events.jsonl")
    injected = next(e for e in events if e["event"] == "fault_injected")
    settled = next(e for e in events if e["event"] == "fault_settled")
    rendezvous = RendezvousSettings()  # the scenario's default
    keep_alive_s = rendezvous.keep_alive_interval_s * rendezvous.keep_alive_max_attempt
    assert settled["ts"] - injected["injected_at"] >= keep_alive_s


def test_an_etcd_restart_that_restarts_the_round_settles_after_the_resume(
    tmp_path: Path,
) -> None:
    runner, job = _runner(tmp_path, _scenario(Fault("etcd-restart", at_step=10)))
    etcd = runner.rendezvous
    original_restart = etcd.restart

    def restart_and_lose_the_round(down_s: float = 0.0, wipe_data: bool = False) -> None:
        original_restart(down_s, wipe_data)
        job.members = ()  # the agents re-rendezvous: the next tick logs a resumed event

    etcd.restart = restart_and_lose_the_round  # type: ignore[method-assign]
    assert runner.run().status == "finished"
    events = read_jsonl(tmp_path / "lab-events.jsonl")
    injected = next(e for e in events if e["event"] == "fault_injected")
    settled = next(e for e in events if e["event"] == "fault_settled")
    rendezvous = RendezvousSettings()
    keep_alive_s = rendezvous.keep_alive_interval_s * rendezvous.keep_alive_max_attempt
    assert settled["ts"] - injected["injected_at"] < keep_alive_s  # no need to wait it out


def test_training_that_ends_before_a_fault_says_which_were_not_injected(tmp_path: Path) -> None:
    scenario = _scenario(
        Fault("kill", node=2, at_step=10),
        Fault("join", at_time=15.0),
        train=TrainSettings(max_steps=40),
    )
    runner, _ = _runner(tmp_path, scenario)
    outcome = runner.run()
    assert outcome.status == "finished" and outcome.injected == 1
    assert outcome.message == (
        "training finished at step 40 before these faults were injected: 1 (join a new node @ "
        "t=15s)"
    )


def test_the_end_moves_only_while_faults_remain_and_only_near_it() -> None:
    assert extended_end(400, 100, faults_remain=True, margin=50) is None  # far from the end
    assert extended_end(400, 350, faults_remain=True, margin=50) is None
    assert extended_end(400, 351, faults_remain=True, margin=50) == 451
    assert extended_end(400, 399, faults_remain=False, margin=50) is None  # all settled


def test_the_margin_is_what_the_job_runs_in_fifteen_seconds_at_its_recent_pace() -> None:
    rate = StepRate()
    assert rate.observe(100.0, 0) == 0.0
    assert rate.observe(102.0, 20) == 10.0
    assert margin_steps(10.0) == 150  # the CI scenario's pace: 0.1 s a step
    assert margin_steps(0.5) == MIN_MARGIN_STEPS  # a loaded machine's
    assert rate.observe(112.0, 40) == 2.0  # the window forgot t=100: 20 steps in 10 s
    assert rate.observe(113.0, 10) == 0.0  # back to an older checkpoint: no progress


def test_a_fault_that_falls_behind_still_fires_and_settles_before_the_end(
    tmp_path: Path,
) -> None:
    # The etcd restart settles only after the keep-alive bound (15 s, 150 fake steps): the
    # kill due at step 110 fires late, after training's planned end at step 200.
    scenario = _scenario(
        Fault("etcd-restart", at_step=100),
        Fault("kill", node=2, at_step=110),
        rendezvous=RendezvousSettings(keep_alive_interval_s=5, keep_alive_max_attempt=3),
    )
    runner, job = _runner(tmp_path, scenario, extendable=True)
    outcome = runner.run()
    assert (outcome.status, outcome.injected) == ("finished", 2), outcome.message
    assert "extended from 200" in outcome.message
    events = read_jsonl(tmp_path / "lab-events.jsonl")
    settled = [e["index"] for e in events if e["event"] == "fault_settled"]
    assert settled == [0, 1]
    injected = [e for e in events if e["event"] == "fault_injected"]
    assert injected[0]["late_from_step"] is None
    assert 110 <= injected[1]["late_from_step"] < 200 < injected[1]["step_at_injection"]
    extended = [e for e in events if e["event"] == "run_extended"]
    assert extended and extended[0]["previous_max_steps"] == 200
    # The fake job runs 10 steps in each fake second: the margin is 15 s of them.
    assert len(extended) >= 2
    assert all(e["max_steps"] - e["step"] == 2 * e["margin"] == 300 for e in extended[1:])
    # The end stops moving once the kill settled, and training ran to the last end set.
    last_settled = next(e for e in reversed(events) if e["event"] == "fault_settled")
    assert all(e["ts"] <= last_settled["ts"] for e in extended)
    assert job.step == extended[-1]["max_steps"]
