"""``python -m bench commit-deadline`` with a small state: the code path of the 1 GB case.

Asserts what was measured is well-formed and every save became durable; the speed targets are
the bench's to judge, with 1 GB of state, and are "not measured" here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.commit_deadline import CommitPlan, commit_targets, large_state, measure_commit_deadline


def test_the_large_state_has_the_size_asked_for() -> None:
    state = large_state(3)
    assert sum(t.numel() * 4 for t in state["model"].values()) == 3 * 2**20


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(180)
def test_a_small_eviction_on_each_store_is_measured_and_durable() -> None:
    results = measure_commit_deadline(CommitPlan(state_mb=4, reps=1), say=lambda line: None)
    assert [e["store"] for e in results["stores"]] == ["directory", "azurite"]
    for entry in results["stores"]:
        (run,) = entry["runs"]
        assert entry["all_durable"] and run["gave_up"] is None, run
        assert 0 < run["local_s"] <= run["durable_s"] <= run["total_s"], run
        assert run["checkpoint_bytes"] > 4 * 2**20
    targets = commit_targets(results)
    assert [t["met"] for t in targets] == [None, None]  # 1 GB is the bench's, not CI's


def test_bad_flags_are_exit_2_and_the_json_lands_in_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["commit-deadline", "--stores", "tape"]) == 2
    assert "--stores: tape is not a store; allowed: directory,azurite" in capsys.readouterr().err
    out = tmp_path / "out"
    assert (
        main(
            ["commit-deadline", "--state-mb=2", "--reps=1", "--stores=directory", "--out", str(out)]
        )
        == 0
    )
    written = json.loads((out / "bench.json").read_text())
    assert written["commit_deadline"]["plan"]["state_mb"] == 2
    assert written["command"][:3] == ["python", "-m", "bench"]
