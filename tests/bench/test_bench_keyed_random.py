"""``python -m bench keyed-random``: charlm's step with dropout off and with its keyed masks,
and the table side by side. Tiny shapes: the command's behaviour, not its numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main

TINY = ["--rounds=1", "--steps=1", "--warmup=0", "--n-layer=1", "--n-embd=16", "--block-size=8"]


def test_it_prints_each_modes_step_time_and_the_masks_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keyed-random", *TINY, f"--json={tmp_path / 'r.json'}"]) == 0
    out = capsys.readouterr().out
    assert "no dropout" in out and "keyed/none" in out and "dropout's own cost" in out
    results = json.loads((tmp_path / "r.json").read_text())
    assert set(results["median_step_s"]) == {"none", "keyed"}
    assert all(v > 0 for v in results["median_step_s"].values())
    cost = results["median_step_s"]["keyed"] - results["median_step_s"]["none"]
    assert results["dropout_cost_s"] == pytest.approx(cost, abs=1e-5)
    assert results["one_site_median_s"] > 0 and "one site's mask alone" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--steps=0"], "--steps"), (["--dropout=0"], "--dropout"), (["--micro-batch=5"], "multiple")],
)
def test_bad_flags_are_one_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keyed-random", *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
