"""``python -m bench chaos`` end to end, two schedules: real etcd, real agents, real faults.

Seeds 1172 and 1173 draw between them every kind of fault but a SIGTERM during a restore
and a plain thaw (tests/bench/test_chaos_schedule.py draws those): kill, freeze, evict,
evict-all then new nodes, join, an etcd outage, a SIGTERM during an upload, a node frozen in
an upload that comes back after the others moved on, a slow store, a failing store, and a
node cut off from its peers for 14 s, 0-3 s apart; the first on nodes of one process, the
second of two. The partition needs network namespaces (root): elsewhere the campaign runs with
``--no-partitions`` (the same faults but the partition) and its test is skipped with the
reason. The campaign itself checks the invariants; this test holds it to 0 violations and to
the shape of what it writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from bench.chaos.invariants import INVARIANTS, TOLERANCE
from bench.chaos.schedule import PARTITION, random_schedule
from lab.local import netns

if TYPE_CHECKING:
    from tests.bench.conftest import BenchRuns

SEED = 1172
MAX_STEPS = 160
"""Both schedules' faults have all started and their nodes are back by about step 60 (their
re-forms pause training; at 0.1 s a step the last heal came at step ~55): 100 paced steps of
margin. The campaign's default 240 only ran 80 more steps at full size after that."""
NO_NAMESPACES = netns.unavailable()
"""Why the partition cannot be made here, or None."""


def bench_command(out: Path) -> tuple[list[str], float]:
    """The campaign's command line and time limit (tests/bench/conftest.py starts it)."""
    command = [sys.executable, "-m", "bench", "chaos", "--schedules", "2", "--seed", str(SEED)]
    command += ["--max-steps", str(MAX_STEPS), "--out", str(out)]
    return command + (["--no-partitions"] if NO_NAMESPACES else []), 900


@pytest.fixture(scope="module")
def campaign(bench_runs: BenchRuns) -> dict[str, Any]:
    run = bench_runs[__name__]
    result = run.finished()
    return {
        "out": run.out,
        "code": result.returncode,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "results": json.loads((run.out / "chaos.json").read_text()),
    }


@pytest.mark.timeout(960)
def test_two_schedules_of_overlapping_faults_keep_every_invariant(campaign: dict) -> None:
    results = campaign["results"]
    lines = [
        f"{r['seed']}: {v['invariant']}: {v['detail']}"
        for r in results["schedules"]
        for v in r["violations"]
    ]
    assert lines == [], campaign["stdout"][-4000:]
    assert campaign["code"] == 0, campaign["stderr"][-3000:]
    summary = results["summary"]
    assert summary["schedules"] == 2
    assert summary["violations_by_invariant"] == dict.fromkeys(INVARIANTS, 0)
    for schedule in results["schedules"]:
        assert schedule["status"] == "finished"
        assert schedule["newest_verified"] == results["plan"]["max_steps"]
        assert schedule["parameter_difference"] <= TOLERANCE


@pytest.mark.timeout(960)
def test_every_drawn_fault_ran_and_each_line_names_its_seed(campaign: dict) -> None:
    results = campaign["results"]
    for index, schedule in enumerate(results["schedules"]):
        seed = SEED + index
        drawn = random_schedule(seed, 3, (3, 6), (1, 2), partitions=not NO_NAMESPACES)
        assert schedule["seed"] == seed
        assert schedule["described"] == drawn.describe()
        assert (
            f"seed {seed}: {len(drawn.faults)} faults, finished, 0 violations"
            in (campaign["stdout"])
        )
        ran = {a["index"] for a in schedule["actions"] if a["index"] >= 0}
        assert ran == set(range(len(drawn.faults)))
        assert json.loads((Path(schedule["out"]) / "schedule.json").read_text())["seed"] == seed
    kinds = {f["kind"] for r in results["schedules"] for f in r["faults"]}
    assert kinds >= {"kill", "freeze", "evict", "evict-all", "etcd", "store-slow", "store-fail"}
    assert "thaw-upload" in kinds
    assert [r["nproc_per_node"] for r in results["schedules"]] == [1, 2]
    assert (campaign["out"] / "chaos.txt").read_text().strip() in campaign["stdout"]


@pytest.mark.timeout(960)
def test_the_partition_cut_a_live_node_off_and_healed_it(campaign: dict) -> None:
    if NO_NAMESPACES:
        pytest.skip(f"a partition needs network namespaces: {NO_NAMESPACES}")
    schedule = campaign["results"]["schedules"][1]
    index = next(i for i, f in enumerate(schedule["faults"]) if f["kind"] == PARTITION)
    mine = [a for a in schedule["actions"] if a["index"] == index]
    assert [a["kind"] for a in mine] == [PARTITION, "healed"], mine
    assert len(mine[0]["nodes"]) == 1 and mine[1]["nodes"] == mine[0]["nodes"]
    assert schedule["violations"] == []
