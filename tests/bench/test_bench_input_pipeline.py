"""``python -m bench input-pipeline``: the step with items fetched in the training thread, by
loader threads and as a stream, side by side. Tiny runs: the command's behaviour, not its
numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main

TINY = ["--rounds=1", "--steps=2", "--warmup=1", "--hidden=8", "--delay-ms=1", "--workers=2"]


def test_it_prints_each_modes_step_time_and_the_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["input-pipeline", *TINY, f"--json={tmp_path / 'r.json'}"]) == 0
    out = capsys.readouterr().out
    assert "inline/workers" in out and "2 workers" in out
    results = json.loads((tmp_path / "r.json").read_text())
    assert set(results["median_step_s"]) == {"inline", "workers", "stream"}
    assert results["steps_per_mode"] == 2
    median = results["median_step_s"]
    assert all(v > 0 for v in median.values())
    # Inline, every step waits at least for its 32 reads of 1 ms.
    assert median["inline"] >= 32e-3
    assert results["inline_over_workers"] == pytest.approx(
        median["inline"] / median["workers"], rel=1e-2
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps=0"], "--steps"),
        (["--delay-ms=-1"], "--delay-ms"),
        (["--micro-batch=5"], "multiple"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["input-pipeline", *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
