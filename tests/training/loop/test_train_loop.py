"""The trainer's exits: emergency saves, peer failures outside the loop, and start-up errors.

Real Trainers on real gloo groups: a world of one in this process, or two spawned ranks where
the test needs a peer to wait on storage. A peer's loss is the exception gloo raises for it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.peer_failures import gloo_peer_closed  # what gloo raises when a peer is gone
from tests.support.trainer_harness import (
    TINY,
    TRAIN_RECORDS,
    harness,
    sigterm_during,
)
from tests.support.waiting import gloo_group
from training import train
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import pack, unpack
from training.checkpoints.storage import FileStore
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.exit_codes import BAD_INPUT, OK, WORKER_RESTART
from training.loop import inputs, metrics
from training.loop import trainer as trainer_module
from training.loop.config import ConfigError
from training.loop.dist import DistEnv, new_checkpoint_group
from training.loop.metrics import Phases
from training.loop.parallel import wrap
from training.records import (
    CHECKPOINT_SAVED,
    EMERGENCY_SAVE,
    PEER_FAILURE,
    RESUMED,
    SETTINGS_CHANGED,
    STORAGE_FAILURE,
    metrics_lines,
    read_lines,
)

# --- Emergency saves --------------------------------------------------------------------------


@pytest.mark.parametrize("stop_requested", [True, False])
def test_rank0_commits_durably_when_its_collective_fails_during_a_stop(
    tmp_path: Path, data_dir: Path, world_of_one: None, stop_requested: bool
) -> None:
    h = harness(tmp_path, data_dir, "--max-steps=6", "--checkpoint-every-steps=0")
    stop = SimpleNamespace(requested=False, at=None)
    real_step = h.trainer.train_step

    def train_step() -> tuple[float, int]:
        if h.trainer.state.step == 2:
            stop.requested = stop_requested  # every node told to stop, or only the peer lost
            raise gloo_peer_closed()
        return real_step()

    h.trainer.train_step = train_step  # type: ignore[method-assign]
    assert h.trainer.run(stop, Phases()) == WORKER_RESTART
    (save,) = h.events(EMERGENCY_SAVE)
    assert (save["step"], save["reason"], save["durable"]) == (2, "peer_failure", stop_requested)
    head = h.durable.head()
    # Without a stop the node stays, and its node-local save is what the next round reads.
    assert (head.step if head else None) == (2 if stop_requested else None)
    assert h.local.load().entry.step == 2


def test_the_sigterm_save_does_not_wait_for_a_stalled_periodic_save(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    release = threading.Event()

    class StallsBackgroundWrites(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            if threading.current_thread().name == "checkpoint":
                release.wait(30)  # a Blob write that hangs until SIGKILL would end it
            return super().put(name, data)

    store = StallsBackgroundWrites(tmp_path / "durable")
    h = harness(tmp_path, data_dir, "--max-steps=8", "--checkpoint-every-steps=2", store=store)
    stop = SimpleNamespace(requested=False, at=None)
    sigterm_during(h, 3, stop)  # the periodic save of step 2 is stuck by then
    try:
        assert h.trainer.run(stop, Phases()) == WORKER_RESTART
        assert h.trainer.saver.busy  # still stuck: the SIGTERM save went ahead beside it
    finally:
        release.set()
    (save,) = h.events(EMERGENCY_SAVE)
    assert (save["step"], save["reason"], save["durable"]) == (3, "sigterm", True)
    assert h.local.load().entry.step == 3
    assert h.trainer.saver.wait(30)  # the stalled step-2 save ends, and must not win
    assert h.durable.head().step == 3


def test_a_stalled_store_cannot_hold_up_the_node_local_save(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    release, saved_locally = threading.Event(), threading.Event()

    class Stalled(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            if name.endswith(".distcp"):
                release.wait(30)
            return super().put(name, data)

    h = harness(tmp_path, data_dir, store=Stalled(tmp_path / "durable"))
    local_commit = h.local.repository.commit

    def commit(*args: Any, **kwargs: Any) -> Any:
        entry = local_commit(*args, **kwargs)
        saved_locally.set()
        return entry

    h.local.repository.commit = commit  # type: ignore[method-assign]
    h.trainer.saver.submit(0, h.trainer.dcp.snapshot())  # a periodic save, stuck in the store
    saving = threading.Thread(target=h.trainer.emergency_save, args=("sigterm",))
    saving.start()
    try:
        assert saved_locally.wait(20), "the node-local save waited for the stalled store"
        assert h.local.load() is not None
        assert saving.is_alive()  # the durable commit is still stuck, after the local save
    finally:
        release.set()
        saving.join(30)
    assert h.durable.head().step == 0


# --- Which saved state may be resumed ----------------------------------------------------------


def test_an_emergency_save_with_other_settings_is_ignored_not_fatal(
    tmp_path: Path, data_dir: Path, world_of_one: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Plain torchrun: every job has this id. Not the last round: the save stays on the node.
    env = DistEnv(run_id="none", max_restarts=3)
    harness(tmp_path, data_dir, env=env).trainer.emergency_save("peer_failure")
    changed = harness(tmp_path, data_dir, "--global-batch-size=16", env=env)
    assert changed.trainer.restore().source == "fresh"
    assert "ignoring the emergency save of step 0" in caplog.text


def test_a_run_started_again_over_an_emptied_store_never_resumes_an_old_node_local_step(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    env = DistEnv(run_id="job-1", max_restarts=3)  # the same runId both times
    first = harness(tmp_path, data_dir, "--max-steps=5", env=env)
    assert first.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    first.trainer.emergency_save("peer_failure")  # step 5, kept on this node only
    assert first.local.load().entry.step == 5
    for path in (tmp_path / "durable").iterdir():  # the checkpoint container emptied
        path.unlink()
    again = harness(tmp_path, data_dir, "--max-steps=3", env=env)
    assert again.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    (resumed,) = again.events(RESUMED)
    assert (resumed["source"], resumed["step"]) == ("fresh", 0)
    assert again.durable.head().step == 3  # its own saves count: none was dropped


def test_resuming_with_another_dataset_size_is_a_clear_error(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    first = harness(tmp_path, data_dir, "--max-steps=1")
    assert first.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    smaller = tmp_path / "smaller"
    write_synthetic_cifar10(smaller, train_records=40, test_records=8, train_files=1)
    # The step -> sample mapping depends on the dataset size: step 1 would be other samples.
    with pytest.raises(ConfigError, match="num_samples=48.*this run has .*num_samples=40"):
        harness(tmp_path, smaller).trainer.restore()


def test_resuming_over_other_data_of_the_same_size_is_a_clear_error(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    _trained_to(tmp_path, data_dir, 1)
    other = tmp_path / "other"
    write_synthetic_cifar10(
        other, train_records=TRAIN_RECORDS, test_records=8, train_files=1, seed=7
    )
    with pytest.raises(
        ConfigError, match="dataset_sha256='[0-9a-f]{64}'; this run has dataset_sha"
    ):
        harness(tmp_path, other).trainer.restore()


@pytest.mark.parametrize(
    ("flag", "key", "old", "new"),
    [
        ("--lr=0.5", "lr", 0.05, 0.5),
        ("--momentum=0.5", "momentum", 0.9, 0.5),
        ("--weight-decay=0.1", "weight_decay", 5e-4, 0.1),
    ],
)
def test_resuming_under_another_optimiser_setting_logs_and_uses_it(
    tmp_path: Path, data_dir: Path, world_of_one: None, flag: str, key: str, old: float, new: float
) -> None:
    """What does not change the saved state's meaning may change on a resume (issue 35)."""
    _trained_to(tmp_path, data_dir, 1)
    h = harness(tmp_path, data_dir, flag)
    h.trainer.restore()
    (changed,) = h.events(SETTINGS_CHANGED)
    assert (changed["step"], changed["changed"]) == (1, {key: {"old": old, "new": new}})
    (group,) = h.trainer.optimizer.param_groups
    assert group[key] == pytest.approx(new)  # the saved optimizer's value gave way


def test_a_state_written_before_a_task_option_existed_resumes_at_its_default(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    first = harness(tmp_path, data_dir, "--max-steps=1", "--model-blocks=2")
    state = first.trainer.dcp.resolved()
    run, settings = unpack(state["run"]), unpack(state["settings"])
    del run["model_blocks"], settings["values"]["dropout"]  # before these options existed
    state = {**state, "run": pack(run), "settings": pack(settings)}
    assert harness(tmp_path, data_dir, "--model-blocks=2").trainer.dcp.apply(state) is None
    with pytest.raises(ConfigError, match="written with model_blocks=2; this run has model_bl"):
        harness(tmp_path, data_dir, "--model-blocks=3").trainer.dcp.apply(state)
    h = harness(tmp_path, data_dir, "--model-blocks=2", "--dropout=0.5")
    h.trainer.dcp.apply(state)
    (changed,) = h.events(SETTINGS_CHANGED)
    assert changed["changed"] == {"dropout": {"old": 0.0, "new": 0.5}}


# --- Peer failures outside the loop -------------------------------------------------------------


def _trained_to(root: Path, data_dir: Path, steps: int) -> None:
    done = harness(root, data_dir, f"--max-steps={steps}")
    assert done.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK


def test_a_peer_failure_while_wrapping_in_ddp_saves_the_restored_state(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _trained_to(tmp_path, data_dir, 3)  # the durable checkpoint the next round restores
    h = harness(tmp_path, data_dir, "--max-steps=6")

    def ddp(*args: object, **kwargs: object) -> None:
        raise gloo_peer_closed()  # DDP's constructor broadcasts the parameters

    monkeypatch.setattr(wrap, "DistributedDataParallel", ddp)
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == WORKER_RESTART
    assert [e["step"] for e in h.events(PEER_FAILURE)] == [3]
    assert [(e["step"], e["reason"]) for e in h.events(EMERGENCY_SAVE)] == [(3, "peer_failure")]
    assert h.local.load().entry.step == 3


def test_a_peer_failure_in_the_final_barrier_follows_the_peer_failure_path(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness(tmp_path, data_dir, "--max-steps=2")

    def barrier(*args: object, **kwargs: object) -> None:
        raise gloo_peer_closed()

    monkeypatch.setattr(dist, "barrier", barrier)
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == WORKER_RESTART
    assert [e["step"] for e in h.events(PEER_FAILURE)] == [2]
    (save,) = h.events(EMERGENCY_SAVE)
    assert (save["step"], save["durable"]) == (2, True)  # rank 0 had committed it already
    assert h.local.load().entry.step == 2 and h.durable.head().step == 2


def test_a_run_never_reads_its_checkpoints_back_to_finish(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    # A fresh run restores nothing; its saves and its end check what the store holds by size,
    # not by downloading a whole state again.
    class Reads(FileStore):
        reads: list[str] = []

        def get(self, name: str) -> bytes:
            if name.endswith(".pt"):
                self.reads.append(name)
            return super().get(name)

    store = Reads(tmp_path / "durable")
    h = harness(tmp_path, data_dir, "--max-steps=3", "--checkpoint-every-steps=1", store=store)
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    assert h.durable.head().step == 3
    assert store.reads == []


def test_a_runs_checkpoints_reach_the_store_from_a_file_never_as_bytes_in_memory(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    # A periodic save and the final one write each rank's part into a file on local disk, which
    # the store streams (or links): the state in memory plus its bytes would be twice it.
    class Puts(FileStore):
        puts: list[str] = []

        def put(self, name: str, data: bytes | Path) -> int:
            if name.endswith(".distcp"):
                self.puts.append(type(data).__name__)
            return super().put(name, data)

    store = Puts(tmp_path / "durable")
    h = harness(tmp_path, data_dir, "--max-steps=3", "--checkpoint-every-steps=2", store=store)
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    assert [e["step"] for e in h.events(CHECKPOINT_SAVED)] == [2]
    assert h.durable.head().step == 3
    assert store.puts == ["PosixPath", "PosixPath"]
    assert list((Path(h.trainer.cfg.checkpoint.local_dir) / ".scratch").iterdir()) == []


def test_finish_commits_when_the_claimed_head_does_not_verify(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    _trained_to(tmp_path, data_dir, 3)
    store = FileStore(tmp_path / "durable")
    head = ShardedCheckpoints(store, tmp_path / "scratch").head()
    assert head is not None and head.step == 3
    store.put(head.name, store.get(head.name)[:100])  # the object behind the claim is damaged
    h = harness(tmp_path, data_dir, "--max-steps=3")
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    read = h.durable.read_whole("model.model.")
    assert read is not None and read[0].step == 3


# --- Start-up errors: named, exit 2, before any collective --------------------------------------


@pytest.fixture
def clean_main(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """main() as a plain ``python`` run: no torchrun or TRAIN_* env; handlers restored after."""
    import os

    for name in list(os.environ):
        if name.startswith("TRAIN_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    sigterm = signal.getsignal(signal.SIGTERM)
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    signal.signal(signal.SIGTERM, sigterm)
    logging.root.handlers, logging.root.level = handlers, level


def _main(tmp_path: Path, data_dir: Path, *flags: str) -> int:
    base = [
        f"--data-dir={data_dir}",
        f"--checkpoint-uri={tmp_path / 'durable'}",
        f"--local-dir={tmp_path / 'local'}",
        *TINY,
    ]
    return train.main([*base, *flags])


def test_an_unusable_checkpoint_path_names_the_setting_and_the_reason(
    tmp_path: Path, data_dir: Path, clean_main: None, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert _main(tmp_path, data_dir, f"--checkpoint-uri={blocker}/ckpt") == BAD_INPUT
    err = capsys.readouterr().err
    assert "--checkpoint-uri (or TRAIN_CHECKPOINT_URI)" in err
    assert "cannot read the checkpoint store" in err and "Not a directory" in err
    assert "Traceback" not in err


@pytest.fixture
def unreachable_blob(monkeypatch: pytest.MonkeyPatch, unused_loopback_port: int) -> str:
    """A checkpoint URI on a loopback port nobody listens on, with Azurite's account."""
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING", "AccountName=devstoreaccount1;AccountKey=a2V5"
    )
    return f"http://127.0.0.1:{unused_loopback_port}/devstoreaccount1/ckpt/run"


def test_an_unreachable_blob_store_names_the_setting_and_the_reason(
    tmp_path: Path,
    data_dir: Path,
    clean_main: None,
    capsys: pytest.CaptureFixture[str],
    unreachable_blob: str,
) -> None:
    uri = unreachable_blob
    assert _main(tmp_path, data_dir, f"--checkpoint-uri={uri}") == BAD_INPUT
    err = capsys.readouterr().err
    assert f"--checkpoint-uri (or TRAIN_CHECKPOINT_URI) {uri}" in err
    assert "cannot reach the blob endpoint" in err and "Traceback" not in err


def test_an_unreachable_blob_store_in_a_later_round_is_a_restart_not_bad_input(
    tmp_path: Path,
    data_dir: Path,
    clean_main: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    unreachable_blob: str,
) -> None:
    # A worker torchrun restarted once: the store answered earlier in this run.
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(inputs, "STORE_RETRY_S", 0.3)
    uri = unreachable_blob
    assert _main(tmp_path, data_dir, f"--checkpoint-uri={uri}") == WORKER_RESTART
    err = capsys.readouterr().err
    assert f"--checkpoint-uri (or TRAIN_CHECKPOINT_URI) {uri}" in err
    assert "still fails after 0.3 s" in err and "Traceback" not in err


def test_a_global_batch_larger_than_the_dataset_is_exit_2(
    tmp_path: Path, data_dir: Path, clean_main: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(tmp_path, data_dir, "--global-batch-size=64") == BAD_INPUT
    err = capsys.readouterr().err
    assert "--global-batch-size (or TRAIN_GLOBAL_BATCH_SIZE) must be between 1" in err
    assert f"and {TRAIN_RECORDS} (the training samples" in err and "Traceback" not in err


def test_a_world_larger_than_the_global_batch_is_exit_2_before_any_collective(
    tmp_path: Path,
    data_dir: Path,
    clean_main: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun's env for rank 0 of 16, with no rendezvous behind it: a collective would fail.
    for name, value in {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    assert _main(tmp_path, data_dir) == BAD_INPUT
    err = capsys.readouterr().err
    assert "--global-batch-size (or TRAIN_GLOBAL_BATCH_SIZE) must be between 16" in err
    assert "got 8" in err and "Traceback" not in err


# --- Storage waits on the checkpoint group ------------------------------------------------------


FROZEN_PEER_S = 10.0
"""The default group's collective timeout in this test: short next to the final save, long
next to the seconds a rank may wait for a core on a loaded two-core machine (with 2 s, a
training step's all-reduce timed out there under a chaos campaign)."""


class _SlowWrites(FileStore):
    """Rank 0's durable store: every checkpoint object takes longer than a collective may."""

    def put(self, name: str, data: bytes | Path) -> int:
        if name.endswith(".distcp"):
            time.sleep(2 * FROZEN_PEER_S)
        return super().put(name, data)


def _finish_worker(rank: int, root: str, data_dir: str, results: dict) -> None:
    # The final save takes twice the frozen-peer timeout.
    with gloo_group(f"{root}/init", rank, 2, timeout_s=FROZEN_PEER_S):
        env = DistEnv(rank=rank, world_size=2, group_rank=rank, run_id="finish")
        node = Path(root) / f"node-{rank}"
        node.mkdir()
        shared = Path(root) / "durable"
        durable = _SlowWrites(shared) if rank == 0 else FileStore(shared)
        h = harness(
            node,
            Path(data_dir),
            "--max-steps=2",
            store=durable,
            env=env,
            group=new_checkpoint_group(60),
        )
        results[rank] = h.trainer.run(SimpleNamespace(requested=False, at=None), Phases())


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(180)
def test_the_final_save_may_take_longer_than_the_collective_timeout(
    tmp_path: Path, data_dir: Path
) -> None:
    results = mp.Manager().dict()
    mp.spawn(_finish_worker, args=(str(tmp_path), str(data_dir), results), nprocs=2, join=True)
    assert dict(results) == {0: OK, 1: OK}
    head = ShardedCheckpoints(FileStore(tmp_path / "durable"), tmp_path / "scratch").head()
    assert head is not None and head.step == 2


def test_a_failed_final_commit_keeps_the_steps_on_the_node_for_the_retry(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    class ManifestWritesFail(FileStore):
        def put_new(self, name: str, data: bytes) -> None:
            if "-manifest-" not in name:
                return super().put_new(name, data)
            raise OSError(f"create {name!r}: Azure Blob error 503 (ServerBusy)")

    store = ManifestWritesFail(tmp_path / "durable")
    failing = harness(
        tmp_path, data_dir, "--max-steps=3", "--checkpoint-every-steps=0", store=store
    )
    assert (
        failing.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == WORKER_RESTART
    )
    assert [e["step"] for e in failing.events(STORAGE_FAILURE)] == [3]
    assert failing.local.load().entry.step == 3
    retry = harness(tmp_path, data_dir, "--max-steps=3", "--checkpoint-every-steps=0")
    assert retry.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    (resumed,) = retry.events(RESUMED)
    assert (resumed["source"], resumed["step"]) == ("local", 3)
    assert retry.durable.head().step == 3


@pytest.mark.parametrize(("restart_count", "durable"), [(1, False), (3, True)])
def test_a_nodes_last_round_commits_its_emergency_save_durably(
    tmp_path: Path, data_dir: Path, world_of_one: None, restart_count: int, durable: bool
) -> None:
    # Not rank 0, but its agent will exit for a new pod, whose disk is empty: the node-local
    # save alone would go with this pod.
    env = DistEnv(rank=1, world_size=2, run_id="r", restart_count=restart_count, max_restarts=3)
    h = harness(tmp_path, data_dir, env=env)
    h.trainer.emergency_save("peer_failure")
    (save,) = h.events(EMERGENCY_SAVE)
    assert save["durable"] is durable
    assert (h.durable.head() is not None) is durable


# --- Metrics lines ----------------------------------------------------------------------------


def test_a_metrics_line_written_late_says_when_its_step_was_applied(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node paused between a step and its metrics line (inside the log's collective) writes
    # the line only after it is thawed. Whoever asks whether a step was applied after a thaw
    # (the thaw test in test_elastic_training.py) needs the step's own time, not the line's.
    late = SimpleNamespace(time=lambda: time.time() + 100.0, monotonic=time.monotonic)
    monkeypatch.setattr(metrics, "time", late)  # every line is written 100 s late
    h = harness(tmp_path, data_dir, "--max-steps=2", "--log-every=1")
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    logged = metrics_lines(read_lines(h.stream.getvalue()))
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["ts"] - r["applied_ts"] >= 99.0 for r in logged)
    assert logged[0]["applied_ts"] <= logged[1]["applied_ts"] <= time.time()


def test_a_step_paused_inside_its_optimizer_step_says_when_its_permit_let_it_through(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node frozen after its permit held and before its optimizer step finished applies that
    # step only once thawed, yet it was let through in a round that was still the run's. The
    # thaw test (test_elastic_training.py) asks whether a step *passed its permit* after the
    # thaw: the step's time is its permit's, not the apply's end.
    offset = [0.0]
    clock = SimpleNamespace(
        time=lambda: time.time() + offset[0], monotonic=time.monotonic, sleep=time.sleep
    )
    monkeypatch.setattr(trainer_module, "time", clock)
    apply, ends = trainer_module.Trainer._apply_gradients, []

    def paused_inside(self: trainer_module.Trainer, norm: object) -> None:
        apply(self, norm)
        offset[0] += 100.0  # SIGSTOP ... SIGCONT inside the optimizer step
        ends.append(clock.time())

    monkeypatch.setattr(trainer_module.Trainer, "_apply_gradients", paused_inside)
    h = harness(tmp_path, data_dir, "--max-steps=2", "--log-every=1")
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == OK
    logged = metrics_lines(read_lines(h.stream.getvalue()))
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["applied_ts"] <= end - 99.0 for r, end in zip(logged, ends, strict=True))
