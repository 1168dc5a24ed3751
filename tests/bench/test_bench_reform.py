"""``python -m bench.reform``: its flags, and what it reads from a node's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.reform.__main__ import main
from bench.reform.peer_loss import _metrics
from training.records import EMERGENCY_SAVE, EVENT, METRICS


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--model-width", "0"]])
def test_bad_flags_name_the_flag(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    assert "--reps and --model-width must be >= 1" in capsys.readouterr().err


def test_only_whole_metrics_lines_at_the_world_size_count(tmp_path: Path) -> None:
    lines = [
        {"ts": 1.0, "kind": METRICS, "world_size": 4, "step": 1},
        {"ts": 2.0, "kind": EVENT, "event": EMERGENCY_SAVE, "step": 1},
        {"ts": 3.0, "kind": METRICS, "world_size": 2, "step": 2},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"ts": 4.0, "kind": "met'
    (tmp_path / "a.out").write_text("a log line\n" + text)
    assert [r["step"] for r in _metrics(tmp_path, "a", 2)] == [2]
    assert _metrics(tmp_path, "a", 2, after=3.0) == []
    assert [r["step"] for r in _metrics(tmp_path, "a", 4)] == [1]
