"""The lab settings the benchmark relies on: emergency saves off, a cap on how long a fault may
take to settle, and ending a run once its last fault settled. Runner tests use the lab's
fake job (``tests/lab/local/test_lab_runner.py``): no processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lab.local.scenario import Fault, ScenarioError, TrainSettings, validate_scenario
from lab.local.scenario_file import scenario_from_dict
from lab.report.node_logs import read_jsonl
from tests.support.fake_lab import _runner, _scenario
from training.loop.config import parse_config


@pytest.mark.parametrize(("on", "flag"), [(True, "true"), (False, "false")])
def test_emergency_saves_reach_the_training_program(on: bool, flag: str) -> None:
    args = TrainSettings(emergency_saves=on).args("/data")
    assert f"--emergency-saves={flag}" in args
    assert parse_config([*args, "--checkpoint-uri=/c"], env={}).checkpoint.emergency_saves is on


def test_scenario_files_take_the_new_keys() -> None:
    scenario = scenario_from_dict(
        {
            "settle_timeout_s": 45,
            "stop_when_settled": True,
            "train": {"emergency_saves": False},
            "faults": [{"kind": "kill", "node": 1, "at_step": 10}],
        },
        default_name="file",
    )
    assert scenario.settle_timeout_s == 45.0
    assert scenario.stop_when_settled is True
    assert scenario.train.emergency_saves is False


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_settle_timeout_must_be_positive(value: float) -> None:
    with pytest.raises(ScenarioError, match="settle_timeout_s: must be > 0"):
        validate_scenario(_scenario(settle_timeout_s=value))


def test_a_fault_that_does_not_settle_in_time_ends_the_run(tmp_path: Path) -> None:
    scenario = _scenario(Fault("freeze", node=0, at_step=5), settle_timeout_s=0.3)
    runner, job = _runner(tmp_path, scenario)
    original_tick = job.tick

    def survivors_hang() -> None:  # a frozen peer with gloo's 30 min timeout
        if not job.nodes[0].frozen:
            original_tick()

    job.tick = survivors_hang
    outcome = runner.run()
    assert outcome.status == "timeout"
    assert outcome.message == "fault 0 (freeze node-0 @ step 5) did not settle within 0.3 s"
    events = [e["event"] for e in read_jsonl(tmp_path / "lab-events.jsonl")]
    assert "fault_injected" in events and "fault_settled" not in events


def test_settle_timeout_does_not_cut_a_fault_that_settles(tmp_path: Path) -> None:
    scenario = _scenario(Fault("kill", node=2, at_step=5), settle_timeout_s=30.0)
    runner, _ = _runner(tmp_path, scenario)
    assert runner.run().status == "finished"


def test_stop_when_settled_ends_the_run_after_the_last_fault(tmp_path: Path) -> None:
    scenario = _scenario(
        Fault("kill", node=2, at_step=5), Fault("join", at_step=10), stop_when_settled=True
    )
    runner, job = _runner(tmp_path, scenario)
    outcome = runner.run()
    assert outcome.status == "settled"
    assert outcome.injected == 2
    assert job.step < scenario.train.max_steps
    events = read_jsonl(tmp_path / "lab-events.jsonl")
    settled = [e["index"] for e in events if e["event"] == "fault_settled"]
    assert settled == [0, 1]
    reached = int(outcome.message.removeprefix("the last fault settled at step "))
    assert 10 <= reached < scenario.train.max_steps


def test_stop_when_settled_without_faults_trains_to_the_end(tmp_path: Path) -> None:
    runner, job = _runner(tmp_path, dataclasses.replace(_scenario(), stop_when_settled=True))
    assert runner.run().status == "finished"
    assert job.step == 200
