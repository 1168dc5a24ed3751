"""An eviction's save: within its deadline, never behind pruning or a read-back, and durable
whenever this node is going away, however its SIGTERM interleaves with a peer's loss.

Real Trainers on a gloo group of one. The SIGTERM thread's work is ``Trainer.stop_now``, with
``exit_now`` recorded instead of ending the test process. Slow and failing stores are doubles
that block on events; nothing here waits on a wall-clock bound except ``--stop-deadline-s``
itself.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.peer_failures import gloo_peer_closed  # what gloo raises when a peer is gone
from tests.support.trainer_harness import Harness, harness, sigterm_during
from training.checkpoints.storage import FileStore
from training.elastic.exit_codes import RETRY_ME, WORKER_RESTART
from training.elastic.faults import StopRequest
from training.loop import inputs, trainer_state
from training.loop.metrics import Phases
from training.loop.run_records import StoredRecords
from training.loop.saves.emergency import commit_node_save
from training.records import CHECKPOINT_FAILED, EMERGENCY_SAVE, events_named, read_lines


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The codes ``exit_now`` was called with (the SIGTERM thread ends the process with it)."""
    codes: list[int] = []
    monkeypatch.setattr(trainer_state, "exit_now", codes.append)
    return codes


def _sigterm_thread(h: Harness, stop: SimpleNamespace) -> threading.Thread:
    """What a SIGTERM starts under torchrun: the stop thread's save, then the exit."""
    stop.requested = True
    thread = threading.Thread(target=h.trainer.stop_now, args=(stop,), name="sigterm")
    thread.start()
    return thread


def _peer_lost_at(h: Harness, step: int) -> None:
    real_step = h.trainer.train_step

    def train_step() -> tuple[float, int]:
        if h.trainer.state.step == step:
            raise gloo_peer_closed()
        return real_step()

    h.trainer.train_step = train_step  # type: ignore[method-assign]


def _node_save_of_step_5(tmp_path: Path, data_dir: Path) -> Harness:
    """A worker that lost its peer at step 5: its save of step 5 is on the node, the durable
    head is step 4 (the periodic save every 4 steps)."""
    first = harness(tmp_path, data_dir, "--checkpoint-every-steps=4")
    _peer_lost_at(first, 5)
    assert first.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == WORKER_RESTART
    assert first.trainer.saver.wait(30)
    return first


# --- Item 3: the commit fits the notice --------------------------------------------------------


def test_past_the_deadline_the_save_gives_up_keeps_the_local_copy_and_says_so(
    tmp_path: Path, data_dir: Path, world_of_one: None, caplog: pytest.LogCaptureFixture
) -> None:
    release = threading.Event()

    class NeverAnswers(FileStore):
        """Checkpoint uploads hang, as a Blob call to a store that stopped answering."""

        def put(self, name: str, data: bytes | Path) -> int:
            if name.endswith((".distcp", ".metadata")):
                release.wait(60)
            return super().put(name, data)

    store = NeverAnswers(tmp_path / "durable")
    h = harness(
        tmp_path, data_dir, "--checkpoint-every-steps=0", "--stop-deadline-s=1", store=store
    )
    stop = SimpleNamespace(requested=False, at=None)
    sigterm_during(h, 3, stop)
    try:
        assert h.trainer.run(stop, Phases()) == RETRY_ME
    finally:
        release.set()
    (save,) = h.events(EMERGENCY_SAVE)
    assert (save["step"], save["durable"], save["local"]) == (3, False, True)
    assert save["gave_up"] == "deadline" and save["deadline_s"] == 1.0
    assert h.local.load().entry.step == 3
    assert "the node-local copy stays in" in caplog.text
    assert h.durable.head() is None


def test_neither_pruning_nor_a_read_back_stands_between_the_sigterm_and_the_publish(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    class OnlyWritesAnswer(FileStore):
        """A store whose object reads and aged listings fail: what pruning and a read-back
        need. The publish needs neither."""

        def get(self, name: str) -> bytes:
            if name.endswith((".distcp", ".metadata")):
                raise OSError(f"get {name!r}: the store is too slow to read it back")
            return super().get(name)

        def list_modified(self, prefix: str = "") -> dict[str, float]:
            if prefix == "dcp-":  # every object with its age: what pruning lists
                raise OSError("list: the store is too slow for pruning")
            return super().list_modified(prefix)

    store = OnlyWritesAnswer(tmp_path / "durable")
    h = harness(tmp_path, data_dir, "--checkpoint-every-steps=0", store=store)
    stop = SimpleNamespace(requested=False, at=None)
    sigterm_during(h, 2, stop)
    assert h.trainer.run(stop, Phases()) == WORKER_RESTART
    (save,) = h.events(EMERGENCY_SAVE)
    assert (save["step"], save["durable"]) == (2, True)
    assert FileStore(tmp_path / "durable").list("dcp-manifest-") == ["dcp-manifest-0000000001.json"]
    assert h.durable.head().step == 2


def test_the_deadline_runs_from_the_signal_not_from_when_the_loop_saw_it(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    # In a plain run the loop sees the SIGTERM's flag only at the next step boundary: a long
    # step later. The notice ran from the signal, so the deadline must too: here the signal
    # came 6 s before the loop saw it, past the 5 s deadline, so the save has no time left.
    h = harness(tmp_path, data_dir, "--checkpoint-every-steps=0", "--stop-deadline-s=5")
    stop = SimpleNamespace(requested=False, at=None)
    real_step = h.trainer.train_step

    def train_step() -> tuple[float, int]:
        if h.trainer.state.step == 2:
            stop.requested, stop.at = True, time.monotonic() - 6.0
        return real_step()

    h.trainer.train_step = train_step  # type: ignore[method-assign]
    assert h.trainer.run(stop, Phases()) == RETRY_ME
    (save,) = h.events(EMERGENCY_SAVE)
    assert (save["step"], save["durable"], save["gave_up"]) == (3, False, "deadline")
    assert h.durable.head() is None


def test_a_stop_request_keeps_when_its_signal_came(monkeypatch: pytest.MonkeyPatch) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop = StopRequest()
        before = time.monotonic()
        signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns
        after = time.monotonic()
        assert stop.requested and stop.at is not None and before <= stop.at <= after
        first = stop.at
        signal.raise_signal(signal.SIGTERM)  # a second signal does not move the first
        assert stop.at == first
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- Item 4: a peer's loss, then this node's own SIGTERM --------------------------------------


@pytest.mark.parametrize("when", ["during the node-local save", "after it, before the exit"])
def test_a_sigterm_after_a_peer_failure_still_commits_the_last_step_durably(
    tmp_path: Path, data_dir: Path, world_of_one: None, exits: list[int], when: str
) -> None:
    h = harness(tmp_path, data_dir, "--checkpoint-every-steps=2")
    stop = SimpleNamespace(requested=False, at=None)
    _peer_lost_at(h, 3)  # the peer left: the node stays, its save is node-local only
    signals: list[threading.Thread] = []
    if when == "during the node-local save":
        local_commit = h.local.repository.commit

        def commit(*args: Any, **kwargs: Any) -> Any:
            entry = local_commit(*args, **kwargs)
            signals.append(_sigterm_thread(h, stop))
            return entry

        h.local.repository.commit = commit  # type: ignore[method-assign]
    else:
        first_save = h.trainer.emergency_save

        def emergency_save(*args: Any, **kwargs: Any) -> Any:
            outcome = first_save(*args, **kwargs)
            if not signals:
                signals.append(_sigterm_thread(h, stop))
            return outcome

        h.trainer.emergency_save = emergency_save  # type: ignore[method-assign]
    h.trainer.run(stop, Phases())
    (sigterm,) = signals
    sigterm.join(30)
    assert not sigterm.is_alive() and exits == [WORKER_RESTART]
    assert h.durable.head().step == 3, "the last completed step is not durable"
    assert _verified_step(h) == 3
    assert {e["step"] for e in h.events(EMERGENCY_SAVE)} == {3}


def _verified_step(h: Harness) -> int:
    """The step of the newest durable checkpoint whose every file verifies."""
    read = h.durable.read_whole("model.model.")
    assert read is not None
    return read[0].step


def test_a_sigterm_before_the_restore_commits_the_nodes_newer_save(
    tmp_path: Path, data_dir: Path, world_of_one: None, exits: list[int]
) -> None:
    # Every node evicted at once: this node's worker had saved step 5 on the node after a
    # peer's loss (the durable head is the periodic step 4); its next worker is stopped
    # before it restored anything. The node's disk goes with the pod.
    first = _node_save_of_step_5(tmp_path, data_dir)
    assert (first.durable.head().step, first.local.load().entry.step) == (4, 5)
    second = harness(tmp_path, data_dir, "--checkpoint-every-steps=4")
    _sigterm_thread(second, SimpleNamespace(at=None)).join(30)
    assert exits == [WORKER_RESTART]
    assert second.durable.head().step == 5 and _verified_step(second) == 5


def test_a_resume_from_a_node_local_save_is_committed_durably_at_once(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    _node_save_of_step_5(tmp_path, data_dir)
    second = harness(tmp_path, data_dir, "--checkpoint-every-steps=4")
    assert second.trainer.restore().source == "local"
    assert second.trainer.saver.wait(30)
    # An eviction of every node now, before the next periodic save, loses nothing.
    assert second.durable.head().step == 5


def test_a_failing_periodic_save_is_reported_and_escalates(
    tmp_path: Path, data_dir: Path, world_of_one: None, caplog: pytest.LogCaptureFixture
) -> None:
    class UploadsFailAfterTheFirst(FileStore):
        uploads = 0

        def put(self, name: str, data: bytes | Path) -> int:
            if name.endswith(".distcp"):
                self.uploads += 1
                if self.uploads > 1:
                    raise OSError(f"put {name!r}: Azure Blob error 503 (ServerBusy)")
            return super().put(name, data)

    store = UploadsFailAfterTheFirst(tmp_path / "durable")
    h = harness(tmp_path, data_dir, "--max-steps=10", "--checkpoint-every-steps=2", store=store)
    real_save = h.trainer.maybe_save

    def maybe_save(last: list[float]) -> None:  # each save ends before the next step
        real_save(last)
        h.trainer.saver.wait(30)

    h.trainer.maybe_save = maybe_save  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING)
    # The final commit fails too: the steps stay on the node for the retry.
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == WORKER_RESTART
    failed = h.events(CHECKPOINT_FAILED)
    assert [(e["step"], e["failures_in_a_row"]) for e in failed] == [
        (4, 1),
        (6, 2),
        (8, 3),
        (10, 4),
    ]
    assert [(e["durable_step"], e["lag_steps"]) for e in failed][-1] == (2, 8)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    escalated = [m for m in errors if "periodic checkpoints in a row failed" in m]
    assert [m.split(" ")[0] for m in escalated] == ["3", "4"]
    assert "the newest durable one is step 2, 8 steps behind" in escalated[-1]


# --- A store that fails for a moment during the eviction's commit ------------------------------


class FailsFirst(FileStore):
    """A directory store whose first ``failures`` writes fail, as a store briefly refusing
    calls (the chaos campaign's seed 9: 1.4 s of failures in the middle of an eviction)."""

    def __init__(self, root: Path, failures: int) -> None:
        super().__init__(root)
        self.failures = failures

    def _fail(self) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise OSError("the store refused the call")

    def put(self, name: str, data: bytes | Path) -> int:
        self._fail()
        return super().put(name, data)

    def put_new(self, name: str, data: bytes) -> None:
        self._fail()
        super().put_new(name, data)


def test_a_store_failing_for_a_moment_does_not_cost_the_eviction_its_durable_commit(
    tmp_path: Path, data_dir: Path, world_of_one: None
) -> None:
    store = FailsFirst(tmp_path / "durable", failures=0)
    h = harness(
        tmp_path, data_dir, "--checkpoint-every-steps=0", "--stop-deadline-s=30", store=store
    )
    stop = SimpleNamespace(requested=False, at=None)
    sigterm_during(h, 3, stop)
    store.failures = 2  # the store refuses the next two calls, then answers again
    assert h.trainer.run(stop, Phases()) == WORKER_RESTART
    (save,) = h.events(EMERGENCY_SAVE)
    assert (save["step"], save["durable"]) == (3, True)
    assert h.durable.head().step == 3


def test_the_agents_commit_of_the_nodes_save_outlasts_a_store_failing_for_a_moment(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _node_save_of_step_5(tmp_path, data_dir)
    flaky = FailsFirst(tmp_path / "durable", failures=2)
    monkeypatch.setattr(inputs, "open_store", lambda uri: flaky)
    cfg, run_id = first.trainer.cfg, first.trainer.env.run_id
    assert commit_node_save(cfg, run_id, None) == 5
    assert first.durable.head().step == 5


# --- The agent's commit makes one commit's store calls ------------------------------------------


class Counting(FileStore):
    """A directory store that records every call: on a slow store each one is a round trip."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []

    def get(self, name: str) -> bytes:
        self.calls.append(("get", name))
        return super().get(name)

    def list(self, prefix: str) -> list[str]:
        self.calls.append(("list", prefix))
        return super().list(prefix)

    def put(self, name: str, data: bytes | Path) -> int:
        self.calls.append(("put", name))
        return super().put(name, data)

    def put_new(self, name: str, data: bytes) -> None:
        self.calls.append(("put_new", name))
        super().put_new(name, data)


def test_the_agents_commit_reads_the_manifests_once(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seed 170 of the chaos campaign: two nodes evicted in their restore while the store
    # answered each call 1 s late. The agent read the manifests three times (opening the store,
    # its "is the node's save newer" check, the publish): 12 calls, past the 10 s deadline, and
    # 10 steps were lost. One read of the manifests, before the upload, is all a commit needs.
    first = _node_save_of_step_5(tmp_path, data_dir)
    counting = Counting(tmp_path / "durable")
    monkeypatch.setattr(inputs, "open_store", lambda uri: counting)
    cfg, run_id = first.trainer.cfg, first.trainer.env.run_id
    assert commit_node_save(cfg, run_id, None) == 5
    assert first.durable.head().step == 5
    ops = [op for op, _ in counting.calls]
    # the lineage; the manifest log (the listing, a look past its end, the head); the upload
    # (the node's file, then DCP's metadata); the new manifest
    assert ops == ["get", "list", "get", "get", "put", "put", "put_new"], counting.calls
    assert counting.calls[4][1].endswith(".distcp") and ops.index("put") > ops.index("list")


def test_the_agents_commit_uploads_nothing_when_the_store_holds_that_step(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _node_save_of_step_5(tmp_path, data_dir)
    cfg, run_id = first.trainer.cfg, first.trainer.env.run_id
    assert commit_node_save(cfg, run_id, None) == 5
    counting = Counting(tmp_path / "durable")
    monkeypatch.setattr(inputs, "open_store", lambda uri: counting)
    assert commit_node_save(cfg, run_id, None) is None  # another node's agent was first
    assert [op for op, _ in counting.calls if op.startswith("put")] == []


def test_a_stop_whose_save_raises_says_why_before_the_process_ends(
    tmp_path: Path,
    data_dir: Path,
    world_of_one: None,
    exits: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The stop thread ends the process in a ``finally`` with os._exit: an error nobody
    # expected in its save left no trace at all (an FSDP2 join in CI lost 6 steps that way,
    # its part's spool file on disk and not one line in the log).
    class Garbled(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            if not name.endswith(".json"):
                raise RuntimeError("a store that breaks in a way nobody wrote down")
            return super().put(name, data)

    h = harness(tmp_path, data_dir, "--checkpoint-every-steps=0", store=Garbled(tmp_path / "d"))
    _peer_lost_at(h, 3)  # the node stays: its save is node-local, the store not asked
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == WORKER_RESTART
    with caplog.at_level(logging.ERROR):
        _sigterm_thread(h, SimpleNamespace(at=None)).join(30)  # now it goes: durable
    assert exits == [WORKER_RESTART]
    assert "a store that breaks in a way nobody wrote down" in caplog.text


def test_the_sigterms_exit_stores_the_runs_records_its_save_included(
    tmp_path: Path, data_dir: Path, world_of_one: None, exits: list[int]
) -> None:
    # The stop thread ends the process with os._exit, past every `finally` of the main
    # thread: the records the run keeps in its storage (lab report --stack) are handed over
    # before, the eviction's own save among them.
    records = FileStore(tmp_path / "records")
    h = harness(tmp_path, data_dir, "--checkpoint-every-steps=0")
    h.trainer.events.sink = StoredRecords(records, "worker-0", interval_s=3600)
    _peer_lost_at(h, 3)
    assert h.trainer.run(SimpleNamespace(requested=False, at=None), Phases()) == WORKER_RESTART
    assert records.list() == []  # nothing stored yet: once per interval, or at the end
    _sigterm_thread(h, SimpleNamespace(at=None)).join(30)
    assert exits == [WORKER_RESTART]
    stored = [r for n in records.list() for r in read_lines(records.get(n).decode())]
    assert events_named(stored, EMERGENCY_SAVE)
