"""The chaos campaign's schedules: random, overlapping, and drawn again from their seed."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.chaos.command import build_parser, plan_from_args
from bench.chaos.schedule import KINDS, MAX_GAP_S, NODE_FAULTS, TRIGGERED, random_schedule


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
