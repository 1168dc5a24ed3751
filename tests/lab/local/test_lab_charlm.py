"""The character LM through the lab: real etcd, real torchrun agents, a node killed hard and a
new one joining; no step lost, and the report shows the validation loss.

A short cut of ``lab/local/scenarios/charlm.toml`` (which runs every fault kind, ~90 s here):
the same task settings, fewer steps and two faults, so the suite pays ~30 s for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.local.scenario_file import load_scenario
from tests.support.lab_runs import run_lab

SCENARIO = """
nodes = 2
min_nodes = 1
max_nodes = 2
timeout_s = 240

[train]
task = "charlm"
task_options = "{options}"
eval_every = 25
lr = 0.003
max_steps = 150  # the join needs a few seconds of steps after it: a node boots
global_batch_size = 16
micro_batch_size = 4
min_step_time_s = 0.25  # the 110 steps after the join outlast a cold start on a busy core
checkpoint_every_steps = 10

[[faults]]
kind = "kill"
node = 1
at_step = 20

[[faults]]
kind = "join"
at_step = 40
"""


@pytest.mark.usefixtures("torchrun")
@pytest.mark.timeout(400)
def test_the_lm_task_recovers_a_kill_and_a_join_with_no_step_lost(tmp_path: Path) -> None:
    options = load_scenario("charlm").train.task_options
    scenario = tmp_path / "charlm-short.toml"
    scenario.write_text(SCENARIO.format(options=options))
    out = tmp_path / "run"
    report = run_lab(scenario, out, timeout_s=360)
    run = report["run"]
    end = run["extended_to_step"] or 150  # moved when the join settles late (a busy machine)
    assert run["finished"] and run["all_recovered"] and run["final_step"] == end
    assert [f["steps_lost"] for f in report["faults"]] == [0, 0]
    validation = run["validation"]
    # Evaluations run every eval_every (25) steps: the last at the end's last multiple.
    assert validation["last_step"] == end - end % 25 and validation["evaluations"] >= 6
    assert validation["last_loss"] < validation["first_loss"]
    assert "validation loss" in (out / "report.txt").read_text()
