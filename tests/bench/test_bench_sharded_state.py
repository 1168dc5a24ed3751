"""``python -m bench sharded-state``: its flags, and a tiny run whose every measured number is
there and positive (its shape, not its speed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.cli import main

SAVE_KEYS = ("share", "runtime", "periodic_s", "periodic_peak", "part_s", "part_bytes")
SAVE_KEYS += ("part_before", "part_peak", "periodic_before")
RESTORE_KEYS = ("share", "runtime", "before", "peak", "loaded_s", "first_step_s")


def _positive(row: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        assert isinstance(row[key], int | float) and row[key] > 0, (key, row)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world", "2", "--restore-world", "2"], "--world must be >= 2 and --restore-world"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--state-mib", "-1"], "--state-mib must be >= 1, got -1"),
    ],
)
def test_bad_flags_name_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["sharded-state", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(900)
def test_quick_run_measures_every_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["sharded-state", "--quick", "--out", str(out)]) == 0
    results = json.loads((out / "bench.json").read_text())
    assert results["command"][:4] == ["python", "-m", "bench", "sharded-state"]
    plan = results["plan"]
    (kind,) = results["fsdp2"]  # a directory only, without --azurite
    entry = results["fsdp2"][kind]
    assert [r["rank"] for r in entry["save"]] == list(range(plan["world"]))
    for row in entry["save"]:
        _positive(row, SAVE_KEYS)
    # The parts together hold the whole state once (plus the trainer's small values).
    assert sum(r["part_bytes"] for r in entry["save"]) >= results["fsdp2_state_bytes"]
    for case in ("killall", "evict", "evict-store"):
        assert [r["rank"] for r in entry[case]] == list(range(plan["restore_world"]))
        for row in entry[case]:
            _positive(row, RESTORE_KEYS)
    assert entry["evict"][0]["complete_s"] > 0  # the coordinator joined the parts
    # Each survivor read its own node's part from its disk, nothing else did.
    assert all(r["kept_files"] >= 1 for r in entry["evict"])
    assert all(r["kept_files"] == 0 for r in entry["killall"] + entry["evict-store"])
    _positive(results["bandwidth"][kind], ("bytes", "seconds", "bytes_per_s"))
    ddp = results["ddp"]
    eviction = ddp["eviction"][kind]["runs"][0]
    assert eviction["durable"]
    _positive(eviction, ("local_s", "durable_s", "checkpoint_bytes"))
    assert [r["rank"] for r in ddp["restore"]] == [0, 1]
    for row in ddp["restore"]:
        _positive(row, ("share", "runtime", "before", "peak", "restore_s"))
    steady = results["steady"]
    assert [r["saving"] for r in steady["runs"]] == [False, True]
    assert 1 <= steady["runs"][1]["saves"] <= plan["steps"] // plan["every"]
    _positive(steady, ("static_step_s", "saving_step_s", "ratio"))
    names = {t["name"] for t in results["targets"]}
    assert {f"save_part, {kind}", "step time, saves/static"} <= names
    text = capsys.readouterr().out
    assert (out / "bench.txt").read_text().strip() in text
