"""The chaos campaign's schedules: random, overlapping, and drawn again from their seed; a
campaign stopped early still reports what it ran."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench import suite
from bench.chaos import campaign, command
from bench.chaos.command import build_parser, plan_from_args
from bench.chaos.plan import ChaosPlan
from bench.chaos.schedule import (
    ARM_S,
    ETCD_CUT,
    ETCD_CUT_S,
    KINDS,
    MAX_GAP_S,
    MAX_THAW_S,
    NETWORK_FAULTS,
    NODE_FAULTS,
    PARTITION,
    PARTITION_S,
    THAWS,
    TRIGGERED,
    ChaosFault,
    Schedule,
    random_schedule,
)


def test_a_seed_draws_the_same_schedule_again() -> None:
    assert random_schedule(7, 3, (3, 6)) == random_schedule(7, 3, (3, 6))
    assert random_schedule(7, 3, (3, 6)) != random_schedule(8, 3, (3, 6))


def test_faults_overlap_and_stay_within_the_plan() -> None:
    for seed in range(300):
        schedule = random_schedule(seed, 3, (3, 6))
        cuts = Counter(f.kind for f in schedule.faults if f.kind in NETWORK_FAULTS)
        assert 3 <= len(schedule.faults) - cuts.total() <= 6 and max(cuts.values(), default=0) <= 1
        assert all(0.0 <= f.gap_s <= MAX_GAP_S for f in schedule.faults)
        assert all(f.kind in KINDS and 0.0 <= f.pick < 1.0 for f in schedule.faults)


def test_a_schedule_never_hits_a_job_with_no_node_or_adds_one_past_the_most() -> None:
    for seed in range(300):
        live = 3
        for fault in random_schedule(seed, 3, (3, 6)).faults:
            lost = (*NODE_FAULTS, *TRIGGERED, *THAWS)  # a thaw may not be back in time
            if fault.kind in (*lost, "evict-all"):
                assert live >= 1, (seed, fault)
            if fault.kind == "join":
                assert live < 3, (seed, fault)
            live = {"join": live + 1, "evict-all": fault.nodes}.get(
                fault.kind, live - 1 if fault.kind in lost else live
            )


def test_every_kind_of_fault_is_drawn() -> None:
    kinds = Counter(f.kind for seed in range(200) for f in random_schedule(seed, 3, (3, 6)).faults)
    assert set(kinds) == set(KINDS)


def test_the_new_draws_leave_every_old_seed_its_faults_but_some_freezes_come_back() -> None:
    # Seed 1004, as drawn before thaws were added (the smoke test's first schedule).
    old = [
        ("kill", 2.93),
        ("store-slow", 1.91),
        ("evict-all", 1.95),
        ("freeze", 2.54),
        ("evict", 0.43),
        ("freeze", 0.28),
    ]
    drawn = random_schedule(1004, 3, (3, 6), (1, 2), partitions=False)
    assert [(f.kind if f.kind not in THAWS else "freeze", f.gap_s) for f in drawn.faults] == old
    for seed in range(300):
        plain = random_schedule(seed, 3, (3, 6), partitions=False)
        mixed = random_schedule(seed, 3, (3, 6), (1, 2), partitions=False)
        assert [(f.gap_s, f.pick) for f in plain.faults] == [
            (f.gap_s, f.pick) for f in mixed.faults
        ]
        assert plain.nproc_per_node == 1 and mixed.nproc_per_node in (1, 2)
        for fault in mixed.faults:
            if fault.kind in THAWS:
                assert 0.0 <= fault.thaw_s <= MAX_THAW_S
            if fault.kind == "thaw-upload":
                assert fault.seconds == ARM_S and 1.0 <= fault.delay_s <= 2.5
    nprocs = Counter(random_schedule(s, 3, (3, 6), (1, 2)).nproc_per_node for s in range(200))
    assert set(nprocs) == {1, 2} and min(nprocs.values()) > 60
    described = random_schedule(7001, 3, (3, 6), (1, 2)).describe()
    assert described.startswith("[2 procs] ") and " thaw " in described


def _times(faults: tuple[ChaosFault, ...]) -> list[tuple[str, float, float]]:
    """(kind, seconds after the start, pick) of every fault but a partition or an etcd-cut."""
    at, found = 0.0, []
    for fault in faults:
        at += fault.gap_s
        if fault.kind not in NETWORK_FAULTS:
            found.append((fault.kind, round(at, 2), fault.pick))
    return found


def test_a_partition_is_put_in_some_schedules_and_every_other_fault_keeps_its_time() -> None:
    # Seed 1004 before partitions: its faults at these times (in seconds from the start).
    old = [2.93, 4.84, 6.79, 9.33, 9.76, 10.04]
    drawn = random_schedule(1004, 3, (3, 6), (1, 2))
    assert [at for _, at, _ in _times(drawn.faults)] == old
    assert [f.kind for f in drawn.faults].count(PARTITION) == 1
    with_partition = 0
    for seed in range(300):
        without = random_schedule(seed, 3, (3, 6), (1, 2), partitions=False)
        schedule = random_schedule(seed, 3, (3, 6), (1, 2))
        assert _times(schedule.faults) == _times(without.faults), seed
        assert schedule.nproc_per_node == without.nproc_per_node
        cuts = [f for f in schedule.faults if f.kind == PARTITION]
        if not cuts:
            kept = [replace(f, gap_s=0) for f in schedule.faults if f.kind != ETCD_CUT]
            assert kept == [replace(f, gap_s=0) for f in without.faults]  # an etcd-cut's gap aside
            continue
        with_partition += 1
        assert PARTITION_S[0] <= cuts[0].seconds <= PARTITION_S[1]
        assert 0.0 <= cuts[0].gap_s <= MAX_GAP_S and 0.0 <= cuts[0].pick < 1.0
        assert "partition for " in schedule.describe()
    assert 60 <= with_partition <= 180  # PARTITION_SHARE of 300, give or take


def test_an_etcd_cut_is_put_in_some_schedules_after_the_partition_was_drawn() -> None:
    with_cut, joins, sizes = 0, Counter(), Counter()
    for seed in range(300):
        schedule = random_schedule(seed, 3, (3, 6), (1, 2))
        without = [f for f in schedule.faults if f.kind != ETCD_CUT]
        # The partition and every other fault are where the seed drew them before.
        assert _times(schedule.faults) == _times(
            random_schedule(seed, 3, (3, 6), (1, 2), partitions=False).faults
        )
        assert [f.kind for f in without].count(PARTITION) == [
            f.kind for f in random_schedule(seed, 3, (3, 6), (1, 2)).faults
        ].count(PARTITION)
        live = 3
        for fault in schedule.faults:
            if fault.kind == ETCD_CUT:
                with_cut += 1
                assert 1 <= fault.nodes <= live and ETCD_CUT_S[0] <= fault.seconds <= ETCD_CUT_S[1]
                joins[fault.join] += 1
                sizes[fault.nodes] += 1
            lost = (*NODE_FAULTS, *TRIGGERED, *THAWS)
            live = {"join": live + 1, "evict-all": fault.nodes}.get(
                fault.kind, live - 1 if fault.kind in lost else live
            )
    assert 40 <= with_cut <= 140  # ETCD_CUT_SHARE of 300, give or take
    assert set(joins) == {True, False} and len(sizes) >= 2  # one node or several, a join or not
    assert not any(
        f.kind == ETCD_CUT
        for s in range(300)
        for f in random_schedule(s, 3, (3, 6), partitions=False).faults
    )
    described = next(
        f.describe() for s in range(300) for f in random_schedule(s, 3, (3, 6)).faults if f.join
    )
    assert "etcd-cut of " in described and "a new node with it" in described


def test_a_partition_lands_only_where_two_nodes_are_expected_to_run() -> None:
    for seed in range(300):
        live = 3
        for fault in random_schedule(seed, 3, (3, 6)).faults:
            if fault.kind == PARTITION:
                assert live >= 2, seed
            lost = (*NODE_FAULTS, *TRIGGERED, *THAWS)
            live = {"join": live + 1, "evict-all": fault.nodes}.get(
                fault.kind, live - 1 if fault.kind in lost else live
            )
    # One node alone has no peer to be cut off from.
    assert not any(
        f.kind == PARTITION for s in range(300) for f in random_schedule(s, 1, (3, 6)).faults
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "--nodes must be 1-6"),
        (["--faults", "4-2"], "--faults must be MIN-MAX with 1 <= MIN <= MAX"),
        (["--faults", "many"], "--faults must be MIN-MAX"),
        (["--max-steps", "5"], "--max-steps must be >= 20"),
        (["--nproc-per-node", "3"], "--nproc-per-node must be a comma-separated list of 1-2"),
        (["--nproc-per-node", "one"], "--nproc-per-node must be a comma-separated list of 1-2"),
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


def test_partitions_where_namespaces_cannot_be_made_name_the_flag_that_leaves_them_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(command.netns, "unavailable", lambda: "making namespaces needs root")
    with pytest.raises(ValueError, match="needs root; run as root or pass --no-partitions"):
        command.check_partitions(plan_from_args(build_parser().parse_args([])))
    plan = plan_from_args(build_parser().parse_args(["--no-partitions"]))
    assert not plan.partitions
    command.check_partitions(plan)  # nothing to make


def test_the_whole_benchmark_leaves_partitions_out_where_namespaces_cannot_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said: list[str] = []
    monkeypatch.setattr(suite.netns, "unavailable", lambda: "making namespaces needs root")
    assert not suite.chaos_plan(ChaosPlan(), said.append).partitions
    assert said == ["chaos: no partitions (making namespaces needs root)"]
    monkeypatch.setattr(suite.netns, "unavailable", lambda: None)
    assert suite.chaos_plan(ChaosPlan(), said.append).partitions and len(said) == 1
