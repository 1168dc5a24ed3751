"""A task that streams its data (tests/training/data/stream_task.py), in float64 on the CPU:
killed everywhere, or stopped by SIGTERM, and resumed at another world size, it ends where an
uninterrupted run ends, and every step 1..N shows completed in some node's log; over another
version of the stream it is not resumed; with no stream at all it is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.exactness import (
    GLOBAL_BATCH,
    TOLERANCE,
    events,
    matches,
    reference,
    run_here,
    run_spawned,
)
from tests.support.trainer_harness import Harness, durable_head, sigterm_during
from tests.training.data.stream_task import REFERENCE, write_points
from training.elastic.exit_codes import BAD_INPUT, OK, WORKER_RESTART
from training.loop.config import ConfigError
from training.records import RESUMED, read_lines, trained_step

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[3]
MAX_STEPS = 10
ARGS = [*GLOBAL_BATCH, f"--task={REFERENCE}", f"--max-steps={MAX_STEPS}"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, training: None) -> Path:
    root = tmp_path_factory.mktemp("stream")
    write_points(root, MAX_STEPS * 12 + 30)  # 10 global batches of 12, in shards of 50
    return root


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory, data: Path) -> dict:
    return reference(tmp_path_factory.mktemp("reference"), data, ARGS)


def completed_steps(*logs: str) -> set[int]:
    """The steps some node said it completed: rank 0's metrics, the other nodes' events."""
    records = [r for log in logs for r in read_lines(log)]
    return {s for r in records if (s := trained_step(r)) is not None}


@pytest.mark.usefixtures("processes")
def test_killed_everywhere_then_resumed_at_another_world_size(
    data: Path, expected: dict, tmp_path: Path
) -> None:
    first = run_spawned(tmp_path, data, 2, [*ARGS, "--checkpoint-every-steps=2"], kill_at=5)
    assert first == {}  # both ranks exited at step 5's boundary, without a word
    # Step 4's periodic save is skipped when step 2's is still being written (one in flight,
    # training never waits): on a loaded machine the head may be step 2.
    head = durable_head(tmp_path / "durable")
    assert head is not None and head.step in (2, 4)
    second = run_spawned(tmp_path, data, 3, [*ARGS, "--checkpoint-every-steps=2"])
    assert {rank: code for rank, (code, _) in second.items()} == {0: OK, 1: OK, 2: 0}
    (resumed,) = events(second[0][1], RESUMED)
    assert (resumed["source"], resumed["step"], resumed["world_size"]) == ("durable", head.step, 3)
    # The steps after the durable head again, in every node's log of the second round.
    for _, log in second.values():
        assert completed_steps(log) == set(range(head.step + 1, MAX_STEPS + 1))
    assert matches(tmp_path, expected) < TOLERANCE


@pytest.mark.usefixtures("processes")
def test_a_sigterm_loses_no_step_and_the_resume_at_another_world_size_matches(
    data: Path, expected: dict, tmp_path: Path
) -> None:
    def sigterm_in_step_4(h: Harness, stop: SimpleNamespace) -> None:
        sigterm_during(h, 4, stop)  # the loop finishes step 4, saves it, and exits

    first, code = run_here(tmp_path, data, ARGS, before=sigterm_in_step_4)
    assert code == WORKER_RESTART
    assert completed_steps(first.stream.getvalue()) == {1, 2, 3, 4}
    second = run_spawned(tmp_path, data, 2, ARGS)
    (resumed,) = events(second[0][1], RESUMED)
    assert (resumed["source"], resumed["step"], resumed["world_size"]) == ("durable", 4, 2)
    logs = [first.stream.getvalue(), *(log for _, log in second.values())]
    assert completed_steps(*logs) == set(range(1, MAX_STEPS + 1))  # no step lost
    assert matches(tmp_path, expected) < TOLERANCE


def test_another_version_of_the_stream_is_not_resumed(data: Path, tmp_path: Path) -> None:
    _, code = run_here(tmp_path, data, [*ARGS, "--max-steps=2"])
    assert code == OK
    other = tmp_path / "v2"
    write_points(other, 60, version="2")
    with pytest.raises(ConfigError, match=r"dataset='points@1'.*dataset='points@2'"):
        run_here(tmp_path, other, [*ARGS, "--max-steps=3"])


@pytest.mark.usefixtures("processes")
def test_a_missing_stream_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "training.train", f"--task={REFERENCE}"]
        + [f"--data-dir={tmp_path / 'nosuch'}", f"--checkpoint-uri={tmp_path / 'durable'}"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == BAD_INPUT, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "--data-dir" in line]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "manifest.json does not exist: a stream needs its manifest" in lines[0]
    assert "Traceback" not in result.stderr
