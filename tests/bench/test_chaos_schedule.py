"""The chaos campaign's schedules: random, overlapping, and drawn again from their seed; a
campaign stopped early still reports what it ran."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench.chaos import campaign
from bench.chaos.command import build_parser, plan_from_args
from bench.chaos.plan import ChaosPlan
from bench.chaos.schedule import (
    KINDS,
    MAX_GAP_S,
    NODE_FAULTS,
    TRIGGERED,
    Schedule,
    random_schedule,
)


def test_a_seed_draws_the_same_schedule_again() -> None:
    assert random_schedule(7, 3, (3, 6)) == random_schedule(7, 3, (3, 6))
    assert random_schedule(7, 3, (3, 6)) != random_schedule(8, 3, (3, 6))


def test_faults_overlap_and_stay_within_the_plan() -> None:
    for seed in range(300):
        schedule = random_schedule(seed, 3, (3, 6))
        assert 3 <= len(schedule.faults) <= 6
        assert all(0.0 <= f.gap_s <= MAX_GAP_S for f in schedule.faults)
        assert all(f.kind in KINDS and 0.0 <= f.pick < 1.0 for f in schedule.faults)


def test_a_schedule_never_hits_a_job_with_no_node_or_adds_one_past_the_most() -> None:
    for seed in range(300):
        live = 3
        for fault in random_schedule(seed, 3, (3, 6)).faults:
            if fault.kind in (*NODE_FAULTS, *TRIGGERED, "evict-all"):
                assert live >= 1, (seed, fault)
            if fault.kind == "join":
                assert live < 3, (seed, fault)
            live = {"join": live + 1, "evict-all": fault.nodes}.get(
                fault.kind, live - 1 if fault.kind in (*NODE_FAULTS, *TRIGGERED) else live
            )


def test_every_kind_of_fault_is_drawn() -> None:
    kinds = Counter(f.kind for seed in range(200) for f in random_schedule(seed, 3, (3, 6)).faults)
    assert set(kinds) == set(KINDS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "--nodes must be 1-6"),
        (["--faults", "4-2"], "--faults must be MIN-MAX with 1 <= MIN <= MAX"),
        (["--faults", "many"], "--faults must be MIN-MAX"),
        (["--max-steps", "5"], "--max-steps must be >= 20"),
    ],
)
def test_bad_flags_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_from_args(build_parser().parse_args(argv))


def test_an_interrupted_campaign_reports_the_schedules_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_then_interrupt(schedule: Schedule, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if schedule.seed > 8:
            raise KeyboardInterrupt
        return {
            # The second is cut short by the Ctrl-C, which the lab's runner turns into an end.
            "status": "finished" if schedule.seed == 7 else "interrupted",
            "seed": schedule.seed,
            "faults": [f.as_dict() for f in schedule.faults],
            "described": schedule.describe(),
            "actions": [],
            "violations": [],
            "excused": [],
            "steps_lost": 0,
            "worst_pause_s": 1.5,
        }

    monkeypatch.setattr(campaign, "find_etcd_binary", lambda: Path("etcd"))
    monkeypatch.setattr(campaign, "reference_parameters", lambda *args: {})
    monkeypatch.setattr(campaign, "run_schedule", one_then_interrupt)
    said: list[str] = []
    results = campaign.run_campaign(ChaosPlan(), seed=7, schedules=3, out=tmp_path, say=said.append)
    assert results["interrupted"] and results["summary"]["schedules"] == 1
    assert said[-1] == "interrupted after 1 of 3 schedules"
    table = campaign.summary_table(results["summary"], results["plan"], 7, 3)
    assert table.startswith("1 schedules from seed 7 (interrupted: 3 planned):")
