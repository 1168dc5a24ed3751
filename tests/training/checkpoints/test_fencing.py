"""The fencing token of a durable commit: the rendezvous round its writer's group formed in.

A group the run has left (cut off from etcd, its self-fence late) must never publish once the
group that replaced it has: every entry carries the run and round of the process that commits
it, and a commit from an older round of the same run than the head's is refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from training.checkpoints.checkpoint import CheckpointRepository, StaleCheckpoint
from training.checkpoints.manifest import ROUND_FILE_ENV, RUN_ID_ENV, Fence
from training.checkpoints.storage import FileStore
from training.elastic import launch


def test_a_commit_from_an_older_round_than_the_heads_is_refused_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileStore(tmp_path / "store")
    new_group = CheckpointRepository(store, fence=Fence("run-1", 3))
    old_group = CheckpointRepository(store, fence=Fence("run-1", 2))
    new_group.commit(10, b"the new group's state")
    with caplog.at_level(logging.WARNING), pytest.raises(StaleCheckpoint, match="round 2"):
        old_group.commit(12, b"a later step, from a group the run has left")
    lines = [r for r in caplog.records if "round" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    loaded = new_group.load_latest()
    assert loaded is not None and loaded.entry.step == 10 and loaded.entry.fence.round == 3
    new_group.commit(14, b"the new group goes on")  # its own round is never refused


def test_a_new_run_of_the_job_is_not_fenced_by_the_last_runs_rounds(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    CheckpointRepository(store, fence=Fence("run-1", 7)).commit(10, b"last run")
    CheckpointRepository(store, fence=Fence("run-2", 1)).commit(11, b"this run, round 1")


def test_the_fence_is_read_from_the_agents_round_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ROUND_FILE_ENV == launch.ROUND_FILE_ENV  # the same file the agent writes
    round_file = tmp_path / "round"
    round_file.write_text(json.dumps({"round": 4, "members": 2}))
    monkeypatch.setenv(ROUND_FILE_ENV, str(round_file))
    monkeypatch.setenv(RUN_ID_ENV, "run-9")
    assert CheckpointRepository(FileStore(tmp_path / "s")).fence == Fence("run-9", 4)
    monkeypatch.delenv(ROUND_FILE_ENV)
    assert CheckpointRepository(FileStore(tmp_path / "s")).fence == Fence("run-9", 0)
