"""``python -m bench keyed-random``: charlm's step with each way of drawing its dropout masks,
and the table side by side. Tiny shapes: the command's behaviour, not its numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.cli import main
from bench.keyed_random.command import per_sample_generator_dropout
from training.api.keyed_random import keyed_seed

TINY = ["--rounds=1", "--steps=1", "--warmup=0", "--n-layer=1", "--n-embd=16", "--block-size=8"]


def test_the_before_draw_is_the_per_sample_generator_one() -> None:
    x = torch.ones(2, 5)
    generator = torch.Generator().manual_seed(keyed_seed((12, 3)))
    expected = (torch.rand(5, generator=generator) >= 0.5).float() / 0.5
    assert torch.equal(per_sample_generator_dropout(x, 0.5, torch.tensor([11, 12]), 3)[1], expected)


def test_it_prints_each_modes_step_time_and_the_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keyed-random", *TINY, f"--json={tmp_path / 'r.json'}"]) == 0
    out = capsys.readouterr().out
    assert "no dropout" in out and "before/after" in out
    results = json.loads((tmp_path / "r.json").read_text())
    assert set(results["median_step_s"]) == {"none", "before", "after"}
    assert all(v > 0 for v in results["median_step_s"].values())
    ratio = results["median_step_s"]["before"] / results["median_step_s"]["after"]
    assert results["before_over_after"] == pytest.approx(ratio, abs=1e-3)
    assert set(results["one_site_median_s"]) == {"before", "after"}
    assert "one site's mask alone" in out


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
