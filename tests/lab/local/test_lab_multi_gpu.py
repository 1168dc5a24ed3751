"""The lab with two training processes per node, as on a 2-GPU VM size: a kill loses no step."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.local.scenario import plan_membership
from lab.local.scenario_file import load_scenario
from tests.support.lab_runs import run_lab

REPO_ROOT = Path(__file__).resolve().parents[3]
SCENARIO = REPO_ROOT / "lab" / "local" / "scenarios" / "multi-gpu.toml"


def test_the_plan_counts_ranks_not_nodes() -> None:
    scenario = load_scenario(str(SCENARIO))
    assert scenario.nproc_per_node == 2
    (kill,) = plan_membership(scenario)
    assert kill.stopped == (1,) and kill.world_size == 2  # one node of two processes left


def _ending_once_settled(directory: Path) -> Path:
    """The scenario, ending once its kill settled (``stop_when_settled``): the 90 paced steps
    after it prove nothing here; finishing after a kill at 2 processes a node is
    tests/training/test_elastic_training.py's (its trajectory checked too)."""
    text = SCENARIO.read_text()
    assert text.count("[train]") == 1
    path = directory / "multi-gpu-settled.toml"
    path.write_text(text.replace("[train]", "stop_when_settled = true\n\n[train]"))
    return path


@pytest.mark.usefixtures("torchrun")
def test_two_processes_per_node_recover_from_a_kill_with_no_lost_step(tmp_path: Path) -> None:
    report = run_lab(_ending_once_settled(tmp_path), tmp_path / "run")
    assert report["outcome"]["status"] == "settled"
    (fault,) = report["faults"]
    assert fault["recovered"] and fault["steps_lost"] == 0
    assert (fault["world_size_before"], fault["world_size_after"]) == (4, 2)
    assert fault["resume_source"] == "local"  # a survivor's emergency save, not the disk
