"""Which store failures before the first collective are a setting (exit 2) and which are a
store down for a while (tried again, then exit 75), by the round the worker is in.

Found by the chaos campaign (seed 3): a store that failed for 3 s while a worker of a later
round opened it ended the job for good, as if its URI were wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from training.checkpoints.checkpoint import CheckpointRepository
from training.checkpoints.storage import FileStore
from training.loop import inputs
from training.loop.config import ConfigError
from training.loop.dist import DistEnv
from training.loop.inputs import StoreUnavailable, load_inputs

FIRST = DistEnv(rank=0, world_size=1, run_id="job", rdzv_round=1)
LATER = DistEnv(rank=0, world_size=1, run_id="job", rdzv_round=2)
RESTARTED = DistEnv(rank=0, world_size=1, run_id="job", restart_count=1)


class FailingFirst(FileStore):
    """A directory store whose first ``failures`` listings raise ``error``."""

    def __init__(self, root: Path, failures: float, error: OSError) -> None:
        super().__init__(root)
        self.failures, self.error, self.calls = failures, error, 0

    def list(self, prefix: str = "") -> list[str]:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return super().list(prefix)


@pytest.fixture
def argv(tmp_path: Path, data_dir: Path) -> list[str]:
    return [
        f"--data-dir={data_dir}",
        f"--checkpoint-uri={tmp_path / 'durable'}",
        f"--local-dir={tmp_path / 'local'}",
        "--global-batch-size=8",
        "--micro-batch-size=8",
    ]


def _store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: object) -> FailingFirst:
    store = FailingFirst(tmp_path / "durable", *args)  # type: ignore[arg-type]
    monkeypatch.setattr(inputs, "open_store", lambda uri: store)
    return store


@pytest.mark.parametrize("env", [LATER, RESTARTED], ids=["later round", "restarted worker"])
def test_a_store_down_for_a_while_in_a_later_round_is_tried_again(
    env: DistEnv, argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(monkeypatch, tmp_path, 3, OSError("list: injected store failure"))
    _, _, opened, _ = load_inputs(argv, env)
    assert store.calls > 3 and opened is store


def test_a_store_that_stays_down_ends_the_round_for_a_restart_naming_the_setting(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _store(monkeypatch, tmp_path, float("inf"), TimeoutError("the endpoint did not answer"))
    monkeypatch.setattr(inputs, "STORE_RETRY_S", 0.5)
    with pytest.raises(StoreUnavailable) as raised:
        load_inputs(argv, LATER)
    message = str(raised.value)
    assert "--checkpoint-uri (or TRAIN_CHECKPOINT_URI)" in message
    assert "still fails after 0.5 s" in message
    assert not isinstance(raised.value, ConfigError)


def test_at_the_first_start_a_failing_store_is_a_setting_at_once(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(monkeypatch, tmp_path, 1, ConnectionError("cannot reach the blob endpoint"))
    with pytest.raises(ConfigError, match="cannot read the checkpoint store"):
        load_inputs(argv, FIRST)
    assert store.calls == 1


def test_a_denied_store_is_a_setting_in_any_round(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(monkeypatch, tmp_path, 1, PermissionError("access denied"))
    with pytest.raises(ConfigError, match="access denied"):
        load_inputs(argv, LATER)
    assert store.calls == 1


@pytest.fixture
def charlm(argv: list[str], tmp_path: Path) -> list[str]:
    """``argv`` for the character LM (a task that can be sharded), on a small corpus."""
    from tests.support.exactness import CORPUS_SAMPLE

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "input.txt").write_text(CORPUS_SAMPLE.read_text()[:4000])
    return [*argv, f"--data-dir={corpus}", "--task=charlm", "--block-size=16"]


def test_a_ddp_run_may_init_from_sharded_checkpoints(charlm: list[str], tmp_path: Path) -> None:
    CheckpointRepository(FileStore(tmp_path / "other"), prefix="dcp").commit(4, b"sharded")
    load_inputs([*charlm, f"--init-from={tmp_path / 'other'}"], FIRST)
    # A sharded run too; with nothing there, either is refused.
    load_inputs([*charlm, "--parallelism=fsdp2", f"--init-from={tmp_path / 'other'}"], FIRST)
    (tmp_path / "empty").mkdir()
    argv = [*charlm, "--parallelism=fsdp2", f"--init-from={tmp_path / 'empty'}"]
    with pytest.raises(ConfigError, match="--init-from .*: no checkpoint there to start from"):
        load_inputs(argv, FIRST)
