"""A loss normalized by a global count, through faults: charlm with ``--line-ends`` (samples of
variable length, padded; its loss a (sum, count) pair over the characters it predicts) in
float64 on the CPU, stopped by a SIGTERM or by a peer lost in the middle of gradient
accumulation, resumed at other world sizes: it ends within 1e-9 (relative) of an uninterrupted
run, and every node's log shows each step completed once, none lost. The world sizes split the
12 samples of a step unevenly in tokens, so a per-rank or per-micro-batch mean would not match.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.elastic_cluster import final_parameters
from tests.support.exactness import (
    events,
    flags,
    make_data,
    raising_in_micro_batch,
    reference,
    run_here,
    run_spawned,
)
from tests.support.peer_failures import gloo_peer_closed
from tests.support.trainer_harness import Harness, sigterm_during
from training.elastic.exit_codes import OK, WORKER_RESTART
from training.records import (
    EMERGENCY_SAVE,
    RESUMED,
    read_lines,
    trained_step,
)
from training.tasks import TASKS

pytestmark = pytest.mark.timeout(300)
MAX_STEPS = 10
ARGS = flags("charlm", "--line-ends=true", "--dropout=0.2", f"--max-steps={MAX_STEPS}")
RELATIVE_TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, training: None) -> Path:
    return make_data("charlm", tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory, data: Path) -> dict[str, torch.Tensor]:
    return reference(tmp_path_factory.mktemp("reference"), data, ARGS)


def _relative_difference(root: Path, expected: dict[str, torch.Tensor]) -> float:
    got = final_parameters(root / "durable")
    scale = max(float(v.abs().max()) for v in expected.values())
    return max(float((got[k] - expected[k]).abs().max()) for k in expected) / scale


def _completed(lines: str) -> list[int]:
    """The steps a node's log says it completed (rank 0's metrics, the others' lines)."""
    return [s for r in read_lines(lines) if (s := trained_step(r)) is not None]


def _logs(spawned: dict[int, tuple[int, str]]) -> list[str]:
    return [lines for _, (_, lines) in sorted(spawned.items())]


def _no_step_lost(segments: list[list[str]]) -> None:
    """Each segment's nodes completed the steps after the last one the previous segment
    completed, every node the same ones, and the segments together every step once."""
    done = 0
    for logs in segments:
        steps = [_completed(lines) for lines in logs]
        assert all(s == steps[0] for s in steps), steps
        for lines in logs[:1]:
            for resumed in events(lines, RESUMED):
                # None: a fresh start, or a durable resume (no node-local save to compare)
                assert resumed["step"] == done and resumed["lost_steps"] in (None, 0)
        assert steps[0] == list(range(done + 1, done + 1 + len(steps[0])))
        done = steps[0][-1]
    assert done == MAX_STEPS


def test_the_samples_have_variable_lengths(data: Path) -> None:
    spec = TASKS["charlm"]
    options = spec.options(block_size=16, line_ends=True)
    train = spec.load_data(str(data), options).train
    lengths = {len(train[i]) for i in range(len(train))}
    assert len(lengths) > 3 and max(lengths) == 17
    newline = spec.load_data(str(data), options).vocabulary.index("\n")
    assert all(int(train[i][-1]) == newline for i in range(len(train)) if len(train[i]) < 17)


@pytest.mark.usefixtures("processes")
def test_a_sigterm_then_a_resume_at_world_size_3(
    data: Path, expected: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    def sigterm_in_step_4(h: Harness, stop: SimpleNamespace) -> None:
        sigterm_during(h, 4, stop)

    first, code = run_here(tmp_path, data, ARGS, before=sigterm_in_step_4)
    assert code == WORKER_RESTART
    second = run_spawned(tmp_path, data, 3, ARGS)
    assert {rank: code for rank, (code, _) in second.items()} == {0: OK, 1: OK, 2: 0}
    (resumed,) = events(second[0][1], RESUMED)
    assert (resumed["source"], resumed["world_size"]) == ("durable", 3)
    _no_step_lost([[first.stream.getvalue()], _logs(second)])
    assert _relative_difference(tmp_path, expected) < RELATIVE_TOLERANCE


@pytest.mark.usefixtures("processes")
def test_a_peer_lost_mid_accumulation_then_a_resume_at_world_size_2(
    data: Path, expected: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    # 12 samples in micro-batches of 4: the peer is lost in the second of step 6's three,
    # after one micro-batch's unnormalized gradients were accumulated.
    faulty = raising_in_micro_batch(TASKS["charlm"], step=5, micro_batch=1, error=gloo_peer_closed)
    first, code = run_here(tmp_path, data, ARGS, spec=faulty)
    assert code == WORKER_RESTART
    (save,) = first.events(EMERGENCY_SAVE)
    assert (save["step"], save["reason"]) == (5, "peer_failure")
    second, code = run_here(tmp_path, data, [*ARGS, "--max-steps=7"])
    assert code == OK
    (resumed,) = second.events(RESUMED)
    assert (resumed["source"], resumed["step"], resumed["lost_steps"]) == ("local", 5, 0)
    third = run_spawned(tmp_path, data, 2, ARGS)
    assert {rank: code for rank, (code, _) in third.items()} == {0: OK, 1: OK}
    _no_step_lost(
        [
            [first.stream.getvalue()],
            [second.stream.getvalue()],
            _logs(third),
        ]
    )
    assert _relative_difference(tmp_path, expected) < RELATIVE_TOLERANCE
